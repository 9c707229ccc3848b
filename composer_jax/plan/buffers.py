"""What holds a compiled step's peak: its largest allocations, read from XLA's own report.

With dumping on (`dump_flags`), XLA writes a memory-usage report next to a module's buffer
assignment: every allocation of the peak by size, with the shapes of the values that share it.
JAX exposes only the totals (`memory_analysis`), so this reads the dump, and names each shape by
the JAX operation that made it (the `op_name` of the first instruction producing that shape in
the optimized module). A plan that does not fit then says what to attack.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

REPORT_SUFFIX = "cpu_after_optimizations-memory-usage-report.txt"
MODULE_SUFFIX = "cpu_after_optimizations.txt"
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# "   35.27GiB(  9%);   35.27GiB;  37874565120;   3; bf16[645,1,7168,2048], 2×f32[64,8192]"
_ROW = re.compile(r"^\s*[\d.]+[KMGT]?i?B\(\s*\d+%\);\s*([\d.]+)([KMGT]?i?B);\s*\d+;\s*\d+;\s*(.*)$")
_SHAPE = re.compile(r"(?:(\d+)×)?([a-z][a-z0-9]*\[[\d,]*\])")
_PRODUCER = re.compile(
    r"^\s*(?:ROOT )?%\S+ = ([a-z][a-z0-9]*\[[\d,]*\])\{[^}]*\} .*?op_name=\"([^\"]+)\""
)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One allocation of the peak: its bytes and the values sharing it, as (shape, how many,
    the JAX operation that made the first of that shape or "")."""

    size_bytes: int
    values: tuple[tuple[str, int, str], ...]


def dump_flags(folder: str, module: str) -> list[str]:
    """XLA flags that dump modules matching `module` (optimized HLO, buffer assignment and its
    memory-usage report) into `folder`, skipping the intermediate passes."""
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


def parse_report(report: str, module_text: str = "") -> list[Allocation]:
    """The allocations of a memory-usage report, largest first, each shape named by the op that
    made it in `module_text` (the optimized HLO) where it is found."""
    makers: dict[str, str] = {}
    for line in module_text.splitlines():
        match = _PRODUCER.match(line)
        if match and " parameter(" not in line:
            makers.setdefault(match.group(1), _short_op(match.group(2)))
    allocations = []
    for line in report.splitlines():
        match = _ROW.match(line)
        if match:
            size = round(float(match.group(1)) * _UNITS[match.group(2)])
            values = tuple(
                (shape, int(count or 1), makers.get(shape, ""))
                for count, shape in _SHAPE.findall(match.group(3))
            )
            allocations.append(Allocation(size, values))
    return sorted(allocations, key=lambda a: -a.size_bytes)


def read_dump(folder: str) -> list[Allocation]:
    """The allocations of the one module dumped into `folder` (see `dump_flags`)."""
    reports = sorted(glob.glob(os.path.join(folder, f"*{REPORT_SUFFIX}")))
    if len(reports) != 1:
        raise ValueError(f"expected one memory-usage report in {folder}, found {len(reports)}")
    module = reports[0][: -len(REPORT_SUFFIX)] + MODULE_SUFFIX
    with open(reports[0]) as f:
        report = f.read()
    text = ""
    if os.path.exists(module):
        with open(module) as f:
            text = f.read()
    return parse_report(report, text)


def render(allocations: list[Allocation], count: int, size) -> str:
    """The `count` largest allocations, one line each: size, then up to three of its values
    with the ops that made them. `size` formats bytes (`costs.size`)."""
    rows = [f"largest allocations XLA made for the step ({count} of {len(allocations)})"]
    for allocation in allocations[:count]:
        named = [
            f"{f'{n}x ' if n > 1 else ''}{shape}{f' ({op})' if op else ''}"
            for shape, n, op in allocation.values[:3]
        ]
        more = len(allocation.values) - 3
        rows.append(
            f"  {size(allocation.size_bytes)}  {'; '.join(named)}"
            + (f"; +{more} more" if more > 0 else "")
        )
    return "\n".join(rows)
