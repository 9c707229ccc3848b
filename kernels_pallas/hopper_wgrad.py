"""Hopper (wgmma) weight-gradient grouped GEMM: out[g] = lhs_g^T @ grad_g, contracting tokens.

The token axis is the contraction here, so every group's rows must start on a `block_t` boundary
(zero rows fill the gaps): the expert-aligned layout of `grouped_layout`, which the MXFP8 wgrad
builds anyway so that no 32-row scale block straddles two experts. One program per (group,
K tile, N tile) of the [G, K, N] result runs a dynamic number of token steps -- the group's
aligned rows / block_t, zero for an empty group (its gradient is zero) -- through the same
multi-stage TMA ring as the forward kernel (`pipeline`). The LHS tile [block_t, block_k] is read
transposed by the wgmma, so neither operand is copied into a transposed layout first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import grouped_layout, mgpu_compat, pipeline, tiling


def _wgrad_kernel(aligned_ends_G, lhs_PK, grad_PN, *, tiles, out_dtype, interpret):
    """out[G, K, N]; group g owns aligned rows [ends[g-1], ends[g]) (multiples of block_t)."""
    k, n = lhs_PK.shape[1], grad_PN.shape[1]
    num_groups = aligned_ends_G.shape[0]
    bk, bn, bt, stages = tiles.block_m, tiles.block_n, tiles.block_k, tiles.stages

    def body(ends_gmem, lhs_gmem, grad_gmem, out_gmem, lhs_smem, grad_smem, out_smem, loaded):
        g, ki, ni = (jax.lax.axis_index(a) for a in ("g", "k", "n"))
        end = ends_gmem[g]
        start = jnp.where(g > 0, ends_gmem[jnp.maximum(g - 1, 0)], 0)
        k_slice, n_slice = pl.ds(ki * bk, bk), pl.ds(ni * bn, bn)

        def issue_loads(step, slot):
            rows = pl.ds(pl.multiple_of(start + step * bt, bt), bt)
            bar = loaded.at[slot]
            plgpu.copy_gmem_to_smem(lhs_gmem.at[rows, k_slice], lhs_smem.at[slot], bar)
            plgpu.copy_gmem_to_smem(grad_gmem.at[rows, n_slice], grad_smem.at[slot], bar)

        def accumulate(acc_ref):
            pipeline.wgmma_k_loop(
                (end - start) // bt,
                stages,
                loaded,
                issue_loads,
                lambda slot: plgpu.wgmma(
                    acc_ref, mgpu_compat.transposed(lhs_smem.at[slot]), grad_smem.at[slot]
                ),
            )
            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((bk, bn)))
        out_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[g, k_slice, n_slice])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        grid=(num_groups, k // bk, n // bn),
        grid_names=("g", "k", "n"),
        scratch_types=[
            plgpu.SMEM((stages, bt, bk), jnp.bfloat16),
            plgpu.SMEM((stages, bt, bn), jnp.bfloat16),
            plgpu.SMEM((bk, bn), out_dtype),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return kernel(aligned_ends_G, lhs_PK, grad_PN)


def _check(lhs, grad, sizes) -> None:
    if lhs.ndim != 2 or grad.ndim != 2 or lhs.shape[0] != grad.shape[0]:
        raise ValueError(f"expected lhs [M, K] and grad [M, N]; got {lhs.shape}, {grad.shape}")
    if sizes.ndim != 1:
        raise ValueError(f"group_sizes must be one-dimensional, got {sizes.shape}")
    if lhs.dtype != jnp.bfloat16 or grad.dtype != jnp.bfloat16:
        raise TypeError(f"operands must be bfloat16, got {lhs.dtype} and {grad.dtype}")


@functools.partial(
    jax.jit,
    static_argnames=("out_dtype", "block_k", "block_n", "block_t", "stages", "interpret"),
)
def aligned_grouped_wgrad(
    lhs_PK: jax.Array,
    grad_PN: jax.Array,
    aligned_sizes_G: jax.Array,
    *,
    out_dtype=jnp.float32,
    block_k: int | None = None,
    block_n: int | None = None,
    block_t: int | None = None,
    stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """[G, K, N] wgrad of rows already in the aligned layout: group sizes multiples of block_t
    (64 unless given), groups back to back from row 0."""
    _check(lhs_PK, grad_PN, aligned_sizes_G)
    k, n = lhs_PK.shape[1], grad_PN.shape[1]
    tiles = tiling.hopper_wgrad_tiles(
        k, n, block_k=block_k, block_n=block_n, block_t=block_t, stages=stages
    )
    pad_k, pad_n, pad_t = -k % tiles.block_m, -n % tiles.block_n, -lhs_PK.shape[0] % 8
    lhs_PK = jnp.pad(lhs_PK, ((0, pad_t), (0, pad_k))) if pad_k or pad_t else lhs_PK
    grad_PN = jnp.pad(grad_PN, ((0, pad_t), (0, pad_n))) if pad_n or pad_t else grad_PN
    ends = jnp.cumsum(aligned_sizes_G.astype(jnp.int32))
    out = _wgrad_kernel(
        ends, lhs_PK, grad_PN, tiles=tiles, out_dtype=jnp.dtype(out_dtype), interpret=interpret
    )
    return out[:, :k, :n] if pad_k or pad_n else out


def grouped_wgrad(
    lhs_MK: jax.Array,
    grad_MN: jax.Array,
    group_sizes_G: jax.Array,
    *,
    block_t: int = 64,
    **kwargs,
) -> jax.Array:
    """out[g] = lhs_g^T @ grad_g over the sorted rows of each group (float32 by default)."""
    _check(lhs_MK, grad_MN, group_sizes_G)
    dest, aligned_sizes, padded_rows = grouped_layout.aligned_destinations(
        group_sizes_G.astype(jnp.int32), lhs_MK.shape[0], block_t
    )
    return aligned_grouped_wgrad(
        grouped_layout.to_aligned_rows(lhs_MK, dest, padded_rows),
        grouped_layout.to_aligned_rows(grad_MN, dest, padded_rows),
        aligned_sizes,
        block_t=block_t,
        **kwargs,
    )


def grouped_wgrad_reference(lhs_MK, grad_MN, group_sizes_G) -> jax.Array:
    """float32 [G, K, N] per-group lhs^T grad (XLA's ragged_dot_general)."""
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return jax.lax.ragged_dot_general(
        lhs_MK,
        grad_MN,
        group_sizes_G.astype(jnp.int32),
        numbers,
        preferred_element_type=jnp.float32,
    )
