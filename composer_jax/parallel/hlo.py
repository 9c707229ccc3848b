"""What one run of a compiled HLO module does on one device: the bytes each collective
produces, the matmul FLOPs, the communication groups, and the largest buffers, with loop trip
counts applied.

Scanned layers compile to a `while` whose body holds one layer's collectives and matmuls, so a
count over the module's text alone sees one layer of many. Here every computation is costed
once, and a `while` multiplies its body's cost by the trip count XLA proved for it
(`known_trip_count` in its backend config); fusions and calls add what they call, a conditional
its most expensive branch. A loop without a known trip count counts once and is reported in
`unknown_trip_loops`. Written here because no library reads XLA's text format: `jax` exposes
the module only as text (`compiled.as_text()`) and its cost analysis counts a loop body once.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

# Element bytes of HLO primitive types.
DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "f8e8m0fnu": 1,
    "f4e2m1fn": 0.5,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_PARAMETER = re.compile(r"(?P<p>[\w.\-]+):\s*(?P<shape>[a-z0-9]+\[[0-9,]*\])")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?(?P<name>%[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+"
    r"(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$"
)
_SHAPE = re.compile(r"\b(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition)=%(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{(?P<dims>[0-9,]*)\}")
_OPERANDS = re.compile(r"%[\w.\-]+")
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')
_GROUPS_LIST = re.compile(r"replica_groups=\{\{(?P<first>[0-9,]*)\}")
_GROUPS_IOTA = re.compile(
    r"replica_groups=\[(?P<shape>[0-9,]+)\]<=\[(?P<dims>[0-9,]+)\](?:T\((?P<perm>[0-9,]+)\))?"
)
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<group>[^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{(?P<pairs>[^=]*?)\}(?:,|$)")


@dataclasses.dataclass
class Collective:
    """One collective instruction: its kind, the bytes it produces per device per execution, how
    many times it executes per module run, and its group: size, and span (the distance in device
    index from its first to its last member, plus one; what decides whether a group stays inside
    one NVLink domain)."""

    kind: str
    bytes: float
    executions: int
    group_size: int
    group_span: int


@dataclasses.dataclass
class Buffer:
    """An instruction's output: bytes, op, and the JAX operation it came from."""

    bytes: float
    op: str
    source: str


@dataclasses.dataclass
class ModuleCosts:
    collectives: list[Collective]
    dot_flops: float
    unknown_trip_loops: int
    largest_buffers: list[Buffer]

    def bytes_by_kind(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for c in self.collectives:
            totals[c.kind] += c.bytes * c.executions
        return dict(totals)

    def count_by_kind(self) -> dict[str, int]:
        totals: dict[str, int] = defaultdict(int)
        for c in self.collectives:
            totals[c.kind] += c.executions
        return dict(totals)


def shape_bytes(shape_text: str) -> float:
    """Bytes of every array in an HLO shape (a tuple's elements summed)."""
    total = 0.0
    for m in _SHAPE.finditer(shape_text):
        if m["dtype"] in DTYPE_BYTES:
            total += math.prod(int(d) for d in m["dims"].split(",") if d) * DTYPE_BYTES[m["dtype"]]
    return total


def _dims(shape_text: str) -> list[int]:
    m = _SHAPE.search(shape_text)
    return [int(d) for d in m["dims"].split(",") if d] if m else []


@dataclasses.dataclass
class _Instruction:
    name: str
    shape: str
    op: str
    rest: str


@dataclasses.dataclass
class _Computation:
    instructions: list[_Instruction] = dataclasses.field(default_factory=list)
    shapes: dict[str, str] = dataclasses.field(default_factory=dict)  # %name -> shape text


def _parse(hlo_text: str) -> tuple[dict[str, _Computation], str]:
    """Computations by name and the entry computation's name."""
    computations: dict[str, _Computation] = {}
    current, entry = None, ""
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = computations.setdefault(head["name"], _Computation())
            entry = head["name"] if line.startswith("ENTRY") else entry
            for param in _PARAMETER.finditer(line):
                current.shapes["%" + param["p"]] = param["shape"]
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current.instructions.append(_Instruction(m["name"], m["shape"], m["op"], m["rest"]))
            current.shapes[m["name"]] = m["shape"]
    if not entry:
        raise ValueError("the HLO text has no ENTRY computation")
    return computations, entry


def _span(members) -> int:
    members = list(members)
    return max(members) - min(members) + 1 if members else 1


def _group(rest: str) -> tuple[int, int]:
    """(size, span) of one group of a collective's replica_groups, in any of XLA's three forms:
    listed ({{0,1},{2,3}}), iota ([G,S]<=[dims]T(perm)) and mesh (mesh['a'=2,'b'=4] {'b'}).
    Mesh axes are taken in device order (the last axis varies fastest), as `jax.make_mesh`
    lays them out."""
    if listed := _GROUPS_LIST.search(rest):
        members = [int(x) for x in listed["first"].split(",") if x]
        return len(members), _span(members)
    if iota := _GROUPS_IOTA.search(rest):
        groups, size = (int(d) for d in iota["shape"].split(",")[-2:])
        dims = [int(d) for d in iota["dims"].split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota["perm"]:
            ids = ids.transpose([int(p) for p in iota["perm"].split(",")])
        return size, _span(ids.reshape(groups, size)[0])
    if mesh := _GROUPS_MESH.search(rest):
        axes = [
            (name.strip().strip("'"), int(n))
            for name, n in (a.split("=") for a in mesh["axes"].split(",") if "=" in a)
        ]
        in_group = {g.strip().strip("'") for g in mesh["group"].split(",") if g.strip()}
        size, span, stride = 1, 1, 1
        for axis, n in reversed(axes):
            if axis in in_group:
                size, span = size * n, stride * (n - 1) + span
            stride *= n
        return size, span
    if pairs := _PAIRS.search(rest):  # collective-permute: one pair is the group
        ends = [int(x) for x in re.findall(r"\d+", pairs["pairs"])[:2]]
        return 2, _span(ends)
    return 1, 1


def _dot_flops(comp: _Computation, shape: str, rest: str) -> float:
    """2 x output elements x contracted elements of a dot."""
    out = math.prod(_dims(shape))
    operands = _OPERANDS.findall(rest.split(")", 1)[0])
    contracting = _CONTRACTING.search(rest)
    if not operands or contracting is None:
        return 0.0
    lhs = _dims(comp.shapes.get(operands[0], ""))
    dims = [int(d) for d in contracting["dims"].split(",") if d]
    return 2.0 * out * math.prod(lhs[d] for d in dims if d < len(lhs))


def _produced(ins: _Instruction) -> str:
    """The output shape of a collective; an async start's tuple also carries its operand."""
    if ins.op.endswith("-start") and ins.shape.startswith("("):
        parts = _SHAPE.findall(ins.shape)
        return "{}[{}]".format(*parts[1]) if len(parts) > 1 else ins.shape
    return ins.shape


@dataclasses.dataclass
class _Cost:
    collectives: list[Collective] = dataclasses.field(default_factory=list)
    flops: float = 0.0
    unknown: int = 0

    def add(self, other: _Cost, times: int = 1) -> None:
        self.collectives += [
            dataclasses.replace(c, executions=c.executions * times) for c in other.collectives
        ]
        self.flops += other.flops * times
        self.unknown += other.unknown


class _Analyzer:
    def __init__(self, computations: dict[str, _Computation]):
        self.computations = computations
        self.memo: dict[str, _Cost] = {}

    def cost(self, name: str, stack: tuple[str, ...] = ()) -> _Cost:
        if name in self.memo:
            return self.memo[name]
        total = _Cost()
        if name in stack or name not in self.computations:
            return total
        comp, inner = self.computations[name], stack + (name,)
        for ins in comp.instructions:
            kind = ins.op.removesuffix("-start")
            called = [m["name"] for m in _CALLED.finditer(ins.rest)]
            if kind in COLLECTIVES:  # its to_apply is the reduction, not work to count
                if not ins.op.endswith("-done"):
                    size, span = _group(ins.rest)
                    total.collectives.append(
                        Collective(kind, shape_bytes(_produced(ins)), 1, size, span)
                    )
            elif ins.op == "dot":
                total.flops += _dot_flops(comp, ins.shape, ins.rest)
            elif ins.op == "while":
                trip = _TRIP_COUNT.search(ins.rest)
                total.unknown += 0 if trip else 1
                for sub in called:
                    total.add(self.cost(sub, inner), int(trip["n"]) if trip else 1)
            elif branches := _BRANCHES.search(ins.rest):
                options = [
                    self.cost(b.strip().lstrip("%"), inner) for b in branches["names"].split(",")
                ]
                total.add(max(options, key=lambda o: o.flops + sum(c.bytes for c in o.collectives)))
            else:
                for sub in called:
                    total.add(self.cost(sub, inner))
        self.memo[name] = total
        return total


# Ops whose output is an alias, a view or the carried state of a loop, not a fresh buffer.
_NOT_BUFFERS = {
    "parameter",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "constant",
    "while",
    "call",
    "conditional",
}


def _largest_buffers(computations: dict[str, _Computation], count: int) -> list[Buffer]:
    """The biggest instruction outputs outside fusions (a fusion's inside never materialises)."""
    fused = {
        m["name"]
        for comp in computations.values()
        for ins in comp.instructions
        if ins.op == "fusion"
        for m in _CALLED.finditer(ins.rest)
    }
    buffers = []
    for name, comp in computations.items():
        if name in fused:
            continue
        for ins in comp.instructions:
            if ins.op in _NOT_BUFFERS:
                continue
            source = _OP_NAME.search(ins.rest)
            buffers.append(Buffer(shape_bytes(ins.shape), ins.op, source["name"] if source else ""))
    return sorted(buffers, key=lambda b: -b.bytes)[:count]


def analyze(hlo_text: str, largest: int = 8) -> ModuleCosts:
    """The per-device costs of one run of a compiled module (`compiled.as_text()`)."""
    computations, entry = _parse(hlo_text)
    total = _Analyzer(computations).cost(entry)
    return ModuleCosts(
        total.collectives, total.flops, total.unknown, _largest_buffers(computations, largest)
    )
