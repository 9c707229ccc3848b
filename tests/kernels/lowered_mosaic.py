"""Reads the Mosaic GPU kernels out of a module lowered for CUDA on CPU.

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` embeds each kernel as serialized
MLIR bytecode in a `mosaic_gpu*` custom call. Parsing it back (unregistered dialects allowed)
gives the kernel's loops and the inline PTX they issue, so ordering properties of a pipeline
(which wait comes before which copy) can be checked without a GPU.
"""

from __future__ import annotations

import dataclasses
import re

from jax._src.lib import mosaic_gpu_dialect
from jax._src.lib.mlir import ir


@dataclasses.dataclass(frozen=True)
class Event:
    kind: str  # "mma" (wgmma issue), "wait" (wgmma.wait_group N), "tma_load" (global -> shared)
    text: str


def _ops(op):
    """Pre-order walk over an operation and everything nested in it."""
    op = getattr(op, "operation", op)
    yield op
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield from _ops(child)


def kernel_modules(lowered) -> list[ir.Module]:
    """The Mosaic GPU kernels of a lowered computation, parsed from their bytecode."""
    found = []
    for op in _ops(lowered.compiler_ir("stablehlo").operation):
        if op.name != "stablehlo.custom_call":
            continue
        target = ir.StringAttr(op.attributes["call_target_name"]).value
        if not target.startswith("mosaic_gpu"):
            continue
        config = ir.DictAttr(op.attributes["mhlo.backend_config"])
        found.append(ir.StringAttr(config["module"]).value_bytes)
    context = ir.Context()
    context.allow_unregistered_dialects = True
    mosaic_gpu_dialect.register_dialect(context)  # its types (barriers) appear in memrefs
    with context:
        return [ir.Module.parse(blob) for blob in found]


_TMA_LOAD = re.compile(r"cp\.async\.bulk\.tensor\.(\d+d\.)?shared(::|\.)\w+\.global")


def _event(op) -> Event | None:
    """Classifies an op by the PTX it issues (inline asm) or, for NVVM ops, by its name."""
    attrs = op.attributes
    text = ir.StringAttr(attrs["asm_string"]).value if "asm_string" in attrs else op.name
    if "wgmma.mma_async" in text:
        return Event("mma", text)
    if "wgmma.wait_group" in text:
        return Event("wait", text.strip())
    if _TMA_LOAD.search(text):
        return Event("tma_load", text)
    return None


def _is_loop(op) -> bool:
    return op.name.endswith(("scf.for", "scf.while"))


def _issues_mma(op) -> bool:
    return any((e := _event(child)) is not None and e.kind == "mma" for child in _ops(op))


def loop_events(module: ir.Module, innermost: bool = False) -> list[list[Event]]:
    """For each loop (`scf.for` / `scf.while`) that issues a wgmma: its wgmma / wait / TMA-load
    events in program order. `innermost` keeps only loops with no wgmma-issuing loop inside (the
    K loops of a persistent kernel, not the loop over its tiles)."""
    loops = []
    for op in _ops(module.operation):
        if not _is_loop(op) or not _issues_mma(op):
            continue
        nested = list(_ops(op))[1:]
        if innermost and any(_is_loop(child) and _issues_mma(child) for child in nested):
            continue
        loops.append([e for child in nested if (e := _event(child)) is not None])
    return loops
