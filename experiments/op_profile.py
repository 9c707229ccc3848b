"""Per-op times of a jitted JAX function (XLA's own ops) and of a torch callable, read from each
framework's profiler, so a benchmark can say which operations a gap is made of.

XLA side: `jax.profiler` writes a Perfetto trace whose events on the CPU carry the names of the
compiled module's instructions (`dot.9`, `ynn_fusion.3`, a fusion, a copy); each is joined to its
line in the optimized HLO for its opcode, shape and the JAX operation it came from (`op_name`
in its metadata). xprof is not needed: the trace is gzipped JSON, read here directly.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import re
import tempfile

import jax

# `%name = shape opcode(operands), ..., metadata={op_name="..." ...}`
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_EINSUM_SPEC = re.compile(r"[a-z,]+->[a-z]+")  # in a name path: `jvp(tkm,tmn->tkn)/dot_general`
_CONTRACTING = re.compile(r"(lhs|rhs)_contracting_dims=\{([\d,]*)\}")


@dataclasses.dataclass(frozen=True)
class OpTime:
    """One op's time per call of the profiled function (summed over its executions in it)."""

    name: str
    ms: float
    count: float  # executions per call (a scanned layer body runs once per layer)
    opcode: str = ""
    shape: str = ""
    source: str = ""  # the JAX operation's name path (jit(...)/ dropped)


def _describe_instructions(hlo_text: str) -> dict[str, tuple[str, str, str]]:
    """name -> (opcode, shape, JAX op name) for every instruction of an optimized HLO module; a
    dot's opcode names its contracting dimensions (`dot lhs{0} rhs{1}`), which decide whether
    XLA:CPU hands it to its fast GEMM library."""
    out = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, shape, opcode = match.groups()
        if opcode == "dot":
            opcode += "".join(f" {side}{{{dims}}}" for side, dims in _CONTRACTING.findall(line))
        op_name = _OP_NAME.search(line)
        out[name] = (opcode, shape, op_name.group(1).split("/", 1)[-1] if op_name else "")
    return out


def _trace_events(logdir: str) -> list[dict]:
    (path,) = glob.glob(f"{logdir}/**/*.trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        events = json.load(f)
    return events["traceEvents"] if isinstance(events, dict) else events


def xla_op_times(fn, *args, repeats: int = 5) -> list[OpTime]:
    """Each op of `jax.jit(fn)(*args)`, slowest first, in milliseconds per call (after two
    warm-up calls). Ops under 1 us in total are left out."""
    compiled = jax.jit(fn).lower(*args).compile()
    described = _describe_instructions(compiled.as_text())
    for _ in range(2):
        jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory(prefix="op_profile_") as logdir:
        with jax.profiler.trace(logdir, create_perfetto_trace=True):
            for _ in range(repeats):
                jax.block_until_ready(compiled(*args))
        events = _trace_events(logdir)
    total_us, count = collections.Counter(), collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("name") in described:
            total_us[event["name"]] += event["dur"]
            count[event["name"]] += 1
    return sorted(
        (
            OpTime(name, us / 1e3 / repeats, count[name] / repeats, *described[name])
            for name, us in total_us.items()
            if us >= 1
        ),
        key=lambda op: -op.ms,
    )


def torch_op_times(fn, repeats: int = 5) -> list[OpTime]:
    """Each aten op `fn()` runs (self CPU time, children excluded), slowest first, in
    milliseconds per call, after two warm-up calls."""
    import torch  # the golden extra: only the peer's side of a benchmark has it

    for _ in range(2):
        fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fn()
    return sorted(
        (
            OpTime(e.key, e.self_cpu_time_total / 1e3 / repeats, e.count / repeats)
            for e in prof.key_averages()
            if e.self_cpu_time_total > 0
        ),
        key=lambda op: -op.ms,
    )


def kind(op: OpTime) -> str:
    """`gemm library` (XLA:CPU's YNNPACK fusions), `dot` (XLA's generic dot), or the opcode
    (`fusion`: elementwise and reductions; `copy`, `while`, ...); torch ops by name, a
    torch.compile graph's calls as one kind."""
    if op.name.startswith("ynn_fusion"):
        return "gemm library"
    if op.name.startswith("## Call CompiledFxGraph"):
        return "torch.compile graph"
    return (op.opcode or op.name).split(" ")[0]


def by_opcode(ops: list[OpTime]) -> dict[str, float]:
    """Milliseconds per call by `kind`, largest first."""
    totals = collections.Counter()
    for op in ops:
        totals[kind(op)] += op.ms
    return dict(totals.most_common())


@dataclasses.dataclass(frozen=True)
class Product:
    """The matrix products of one JAX operation at one output shape, in one pass."""

    backward: bool  # from autodiff's transpose (or a custom VJP's backward)
    operation: str  # the einsum spec (`tkm,tmn->tkn`), else the op's last name (`dot_general`)
    shape: str
    ms: float
    runs: float  # executions per call, summed over the ops grouped here


def by_product(ops: list[OpTime]) -> list[Product]:
    """The GEMM-library and generic-dot ops grouped by pass, JAX operation and output shape,
    slowest first: which product of the model a backward's GEMM time goes to, set against the
    same operation's forward."""
    totals: dict[tuple, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for op in ops:
        if kind(op) not in ("gemm library", "dot"):
            continue
        specs = _EINSUM_SPEC.findall(op.source)
        key = (
            "transpose(" in op.source,
            specs[-1] if specs else op.source.rsplit("/", 1)[-1] or op.name,
            op.shape.split("{")[0],
        )
        totals[key][0] += op.ms
        totals[key][1] += op.count
    products = [Product(*key, ms, runs) for key, (ms, runs) in totals.items()]
    return sorted(products, key=lambda p: -p.ms)


def format_products(products: list[Product], top: int = 20) -> str:
    """The `top` costliest products as a markdown table."""
    lines = ["| pass | operation | output | ms / call | runs / call |"]
    lines.append("| --- | --- | --- | ---: | ---: |")
    for p in products[:top]:
        direction = "backward" if p.backward else "forward"
        lines.append(f"| {direction} | {p.operation} | {p.shape} | {p.ms:.2f} | {p.runs:g} |")
    return "\n".join(lines)


def format_ops(ops: list[OpTime], top: int = 15) -> str:
    """The `top` slowest ops as a markdown table, with the share of the whole."""
    whole = sum(op.ms for op in ops) or 1.0
    lines = ["| op | ms / call | share | runs / call | opcode | shape | from |"]
    lines.append("| --- | ---: | ---: | ---: | --- | --- | --- |")
    for op in ops[:top]:
        lines.append(
            f"| {op.name} | {op.ms:.2f} | {op.ms / whole:.0%} | {op.count:g} | {op.opcode} "
            f"| {op.shape[:40]} | {op.source[-80:]} |"
        )
    return "\n".join(lines)
