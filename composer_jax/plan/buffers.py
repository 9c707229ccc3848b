"""What holds a compiled step's peak: its largest buffers, read from XLA's buffer assignment.

JAX exposes only a compiled step's memory totals (`memory_analysis`). With dumping on
(`dump_flags`), XLA writes the module's buffer assignment: every allocation (the arguments, and
one block of temporaries whose values reuse each other's space as their lifetimes allow), each
value with its instruction, size and offset. Here the temporaries are cut into regions (values
whose byte ranges overlap share a region, so the regions add up to the block), and each value is
named by the JAX operation that made it (its instruction's `op_name` in the optimized module). A
plan that does not fit then says what to attack.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re

ASSIGNMENT_SUFFIX = "cpu_after_optimizations-buffer-assignment.txt"
MODULE_SUFFIX = "cpu_after_optimizations.txt"
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*):$")
_VALUE = re.compile(
    r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): ([a-z][a-z0-9]*\[[\d,]*\])"
)
_OP_NAME = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*?op_name=\"([^\"]+)\"")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """An argument allocation or a region of the temporaries: its bytes and the values in it
    as (shape, the JAX operation that made it or the instruction's name)."""

    size_bytes: int
    kind: str  # "argument", "temporaries" or XLA's word for it (constant, output, ...)
    values: tuple[tuple[str, str], ...]


def dump_flags(folder: str, module: str) -> list[str]:
    """XLA flags that dump modules matching `module` (optimized HLO and buffer assignment)
    into `folder`, skipping the intermediate passes."""
    return [
        f"--xla_dump_to={folder}",
        "--xla_dump_hlo_pass_re=NONE",
        f"--xla_dump_hlo_module_re={module}",
    ]


def _short_op(op_name: str) -> str:
    """The operation itself (with its einsum for a product), "backward" where autodiff's
    transpose made it: the nesting of transformations and scopes is left out."""
    parts = op_name.split("/")
    name = "/".join(parts[-2:]) if parts[-1] == "dot_general" and len(parts) > 1 else parts[-1]
    return f"backward {name}" if "transpose(" in op_name else name


def _allocations(assignment: str):
    """(size, description, [(instruction, size, offset, shape)]) per allocation."""
    allocations = []
    for line in assignment.splitlines():
        if match := _ALLOCATION.match(line):
            allocations.append((int(match.group(1)), match.group(2), []))
        elif (match := _VALUE.match(line)) and allocations:
            name, size, offset, shape = match.groups()
            allocations[-1][2].append((name, int(size), int(offset), shape))
    return allocations


def _regions(values):
    """The temporaries' values grouped where their byte ranges overlap: (size, values)."""
    regions, end = [], -1
    for value in sorted(values, key=lambda v: v[2]):
        _, size, offset, _ = value
        if offset >= end:
            regions.append([offset, offset + size, [value]])
        else:
            regions[-1][1] = max(regions[-1][1], offset + size)
            regions[-1][2].append(value)
        end = regions[-1][1]
    return [(stop - start, members) for start, stop, members in regions]


def parse(assignment: str, module_text: str = "") -> list[Buffer]:
    """The buffers of a buffer assignment, largest first, values named by their ops."""
    ops = {
        m.group(1): _short_op(m.group(2))
        for m in map(_OP_NAME.match, module_text.splitlines())
        if m
    }

    def named(values):
        return tuple((shape, ops.get(name, name)) for name, _, _, shape in values)

    buffers = []
    for size, description, values in _allocations(assignment):
        if "preallocated-temp" in description:
            buffers += [Buffer(s, "temporaries", named(v)) for s, v in _regions(values)]
        else:
            kind = "argument" if description.startswith("page 0, parameter") else description
            buffers.append(Buffer(size, kind.replace("page 0, ", "").split(",")[0], named(values)))
    return sorted(buffers, key=lambda b: -b.size_bytes)


def read_dump(folder: str) -> list[Buffer]:
    """The buffers of the one module dumped into `folder` (see `dump_flags`)."""
    found = sorted(glob.glob(os.path.join(folder, f"*{ASSIGNMENT_SUFFIX}")))
    if len(found) != 1:
        raise ValueError(f"expected one buffer assignment in {folder}, found {len(found)}")
    with open(found[0]) as f:
        assignment = f.read()
    module = found[0][: -len(ASSIGNMENT_SUFFIX)] + MODULE_SUFFIX
    text = ""
    if os.path.exists(module):
        with open(module) as f:
            text = f.read()
    return parse(assignment, text)


def render(buffers: list[Buffer], count: int, size) -> str:
    """The `count` largest buffers, one line each: size, kind, and its three most frequent
    (shape, op) values. `size` formats bytes (`costs.size`)."""
    rows = [f"largest buffers of the step ({count} of {len(buffers)})"]
    for buffer in buffers[:count]:
        common = collections.Counter(buffer.values).most_common(3)
        named = [f"{f'{n}x ' if n > 1 else ''}{shape} ({op})" for (shape, op), n in common]
        more = len(buffer.values) - sum(n for _, n in common)
        rows.append(
            f"  {size(buffer.size_bytes)}  {buffer.kind}: {'; '.join(named)}"
            + (f"; +{more} more" if more > 0 else "")
        )
    return "\n".join(rows)
