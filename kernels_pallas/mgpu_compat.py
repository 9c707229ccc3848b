"""Mosaic GPU spellings that differ between JAX 0.11 (the GPU machine) and 0.12 (CPU machines)."""

from __future__ import annotations

import inspect

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def transposed(ref):
    """A 2D SMEM ref viewed transposed, as an MMA operand."""
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    return plgpu.transpose_ref(ref, (1, 0))


def warp_map(body) -> None:
    """Runs `body(warp_id)` once per warp of the current warpgroup."""
    if hasattr(plgpu, "warp_map"):
        return plgpu.warp_map(body)
    return pl.core_map(plgpu.WarpMesh(axis_name="warp"))(lambda: body(jax.lax.axis_index("warp")))


def load(ref, layout, *, optimized: bool = True):
    """Loads a whole SMEM or GMEM ref into registers with `layout` (older JAX took an index).

    JAX 0.11 loads with its own layout first and casts afterwards, so a small GMEM vector (the
    epilogue's factors) has no "optimized" transfer there: pass optimized=False for those.
    """
    params = inspect.signature(plgpu.load).parameters
    if "idx" in params and params["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout, optimized=optimized)
    return plgpu.load(ref, layout=layout, optimized=optimized)
