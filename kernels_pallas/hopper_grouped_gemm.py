"""Hopper (wgmma) grouped GEMMs for the low-precision MoE op, in Pallas Mosaic GPU.

Contract (shared with the jnp reference in `grouped_layout`): rows of the LHS sorted by group,
rows of group g multiply the RHS of group g, float32 result, rows past sum(group_sizes) zero.

Hopper has no block-scaled MMA, so two kernels:
  `mxfp8_grouped_gemm`: fp8 codes straight from memory; one fp8 wgmma per 32-wide scale block,
      its partial product promoted into the float32 accumulator times the row (token) scales and
      column scales of that block.
  `grouped_gemm`: bf16 operands, fed "codes times block scales" for NVFP4 (exact in bf16; Hopper
      has no fp4 MMA); the NVFP4 per-token factors are applied by the caller.

Layout: each group's rows are moved to a `block_m`-aligned start (`grouped_layout`), so every
M tile belongs to one group; a tile finds its group from the aligned group ends. Grid (M tiles,
N tiles), software pipeline over K.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import grouped_layout, mgpu_compat

MX_BLOCK = 32


def _check(lhs_MK, rhs_GKN, group_sizes_G, block_m, block_n, block_k) -> None:
    if lhs_MK.ndim != 2 or rhs_GKN.ndim != 3 or lhs_MK.shape[1] != rhs_GKN.shape[1]:
        raise ValueError(f"expected lhs [M, K], rhs [G, K, N]; got {lhs_MK.shape}, {rhs_GKN.shape}")
    if group_sizes_G.shape != (rhs_GKN.shape[0],):
        raise ValueError(f"group_sizes must be [{rhs_GKN.shape[0]}], got {group_sizes_G.shape}")
    if lhs_MK.dtype != jnp.bfloat16 or rhs_GKN.dtype != jnp.bfloat16:
        raise TypeError(f"operands must be bfloat16, got {lhs_MK.dtype} and {rhs_GKN.dtype}")
    if block_m % 64 or block_n % 8 or block_k % 64:
        raise ValueError("wgmma tiles need block_m % 64, block_n % 8, block_k % 64 == 0")


def _aligned_grouped_gemm(
    tile_ends_G, lhs_PK, rhs_GKN, *, block_m, block_n, block_k, interpret
) -> jax.Array:
    """The kernel proper on the aligned layout: out[P, N] float32."""
    padded_rows, k = lhs_PK.shape
    num_groups, _, n = rhs_GKN.shape
    grid_m, grid_n = padded_rows // block_m, n // block_n

    def body(tile_ends_gmem, lhs_gmem, rhs_gmem, out_gmem):
        mi, ni = jax.lax.axis_index("m"), jax.lax.axis_index("n")
        group = jnp.int32(0)
        for g in range(num_groups - 1):  # few experts per device: unrolled scalar compares
            group += (mi >= tile_ends_gmem[g]).astype(jnp.int32)

        def accumulate(acc_ref):
            def step(_, lhs_smem, rhs_smem):
                plgpu.wgmma(acc_ref, lhs_smem, rhs_smem)
                # The wgmma of the previous step has finished reading its slot before the
                # pipeline refills that slot (delay_release=1 below).
                plgpu.wgmma_wait(1)

            plgpu.emit_pipeline(
                step,
                grid=(k // block_k,),
                in_specs=[
                    plgpu.BlockSpec((block_m, block_k), lambda ki: (mi, ki), delay_release=1),
                    plgpu.BlockSpec((block_k, block_n), lambda ki: (ki, ni), delay_release=1),
                ],
                max_concurrent_steps=3,
            )(lhs_gmem, rhs_gmem.at[group])
            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((block_m, block_n)))

        _store_tile(acc, out_gmem, mi, ni, block_m, block_n)

    kernel = _tile_kernel(body, padded_rows, n, grid_m, grid_n, interpret)
    return kernel(tile_ends_G, lhs_PK, rhs_GKN)


def _store_tile(acc, out_gmem, mi, ni, block_m: int, block_n: int) -> None:
    """Writes one float32 output tile through shared memory with a TMA copy."""

    def store(out_smem):
        out_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            out_smem, out_gmem.at[pl.ds(mi * block_m, block_m), pl.ds(ni * block_n, block_n)]
        )
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((block_m, block_n), jnp.float32))


def _tile_kernel(body, rows: int, n: int, grid_m: int, grid_n: int, interpret: bool):
    """A warpgroup-semantics kernel with one program per (m tile, n tile) of a [rows, n] output."""
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((rows, n), jnp.float32),
        grid=(grid_m, grid_n),
        grid_names=("m", "n"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def grouped_gemm(
    lhs_MK: jax.Array,
    rhs_GKN: jax.Array,
    group_sizes_G: jax.Array,
    *,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 64,
    interpret: bool = False,
) -> jax.Array:
    """float32 grouped GEMM on Hopper tensor cores (`interpret` runs it on CPU)."""
    _check(lhs_MK, rhs_GKN, group_sizes_G, block_m, block_n, block_k)
    group_sizes_G = group_sizes_G.astype(jnp.int32)
    dest, aligned_sizes, padded_rows = grouped_layout.aligned_destinations(
        group_sizes_G, lhs_MK.shape[0], block_m
    )
    n = rhs_GKN.shape[2]
    pad_k, pad_n = -lhs_MK.shape[1] % block_k, -n % block_n  # zeros: the product is unchanged
    lhs_MK = jnp.pad(lhs_MK, ((0, 0), (0, pad_k)))
    rhs_GKN = jnp.pad(rhs_GKN, ((0, 0), (0, pad_k), (0, pad_n)))
    lhs_PK = grouped_layout.to_aligned_rows(lhs_MK, dest, padded_rows)
    tile_ends = jnp.cumsum(aligned_sizes) // block_m
    out_PN = _aligned_grouped_gemm(
        tile_ends,
        lhs_PK,
        rhs_GKN,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        interpret=interpret,
    )
    return grouped_layout.from_aligned_rows(out_PN, dest)[:, :n]


def _aligned_mxfp8_grouped_gemm(
    tile_ends_G, lhs_PK, lhs_scales_BP, rhs_GNK, rhs_scales_GBN, *, block_m, block_n, interpret
) -> jax.Array:
    """fp8 wgmma per 32-wide scale block, promoted into a float32 accumulator with its scales."""
    padded_rows, k = lhs_PK.shape
    num_groups, n, _ = rhs_GNK.shape
    grid_m, grid_n = padded_rows // block_m, n // block_n
    block_k = MX_BLOCK

    def body(tile_ends_gmem, lhs_gmem, lhs_sc_gmem, rhs_gmem, rhs_sc_gmem, out_gmem):
        mi, ni = jax.lax.axis_index("m"), jax.lax.axis_index("n")
        group = jnp.int32(0)
        for g in range(num_groups - 1):
            group += (mi >= tile_ends_gmem[g]).astype(jnp.int32)

        def step(_, lhs_smem, rhs_smem, lhs_sc_smem, rhs_sc_smem, acc):
            def block_product(partial_ref):
                plgpu.wgmma(partial_ref, lhs_smem, mgpu_compat.transposed(rhs_smem))
                return partial_ref[...]

            partial = pl.run_scoped(block_product, plgpu.ACC((block_m, block_n)))
            rows = plgpu.load(lhs_sc_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
            cols = plgpu.load(rhs_sc_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(0))
            shape = (block_m, block_n)
            rows = jax.lax.broadcast_in_dim(rows, shape, [0])
            cols = jax.lax.broadcast_in_dim(cols, shape, [1])
            return acc + partial * rows * cols

        zeros = plgpu.layout_cast(jnp.zeros((block_m, block_n), jnp.float32), plgpu.Layout.WGMMA)
        acc = plgpu.emit_pipeline(
            step,
            grid=(k // block_k,),
            in_specs=[
                plgpu.BlockSpec((block_m, block_k), lambda ki: (mi, ki)),
                plgpu.BlockSpec((block_n, block_k), lambda ki: (ni, ki)),
                plgpu.BlockSpec((1, block_m), lambda ki: (ki, mi)),
                plgpu.BlockSpec((1, block_n), lambda ki: (ki, ni)),
            ],
            max_concurrent_steps=2,
            init_carry=zeros,
        )(lhs_gmem, rhs_gmem.at[group], lhs_sc_gmem, rhs_sc_gmem.at[group])

        _store_tile(acc, out_gmem, mi, ni, block_m, block_n)

    kernel = _tile_kernel(body, padded_rows, n, grid_m, grid_n, interpret)
    return kernel(tile_ends_G, lhs_PK, lhs_scales_BP, rhs_GNK, rhs_scales_GBN)


def _e8m0_to_f32(scale_bytes: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(scale_bytes, jnp.float8_e8m0fnu).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "interpret"))
def mxfp8_grouped_gemm(
    lhs_MK: jax.Array,
    lhs_scales: jax.Array,
    rhs_GNK: jax.Array,
    rhs_scales: jax.Array,
    group_sizes_G: jax.Array,
    *,
    block_m: int = 64,
    block_n: int = 64,
    interpret: bool = False,
) -> jax.Array:
    """float32 MXFP8 grouped GEMM: fp8 wgmma with per-block promotion (no bf16 copies).

    lhs [M, K] and rhs [G, N, K] float8_e4m3fn codes with E8M0 scale bytes [M, K/32] and
    [G, N, K/32], all blocked along K (the RHS K-major, as fp8 wgmma requires).
    """
    if lhs_MK.dtype != jnp.float8_e4m3fn or rhs_GNK.dtype != jnp.float8_e4m3fn:
        raise TypeError(f"codes must be float8_e4m3fn, got {lhs_MK.dtype} and {rhs_GNK.dtype}")
    m, k = lhs_MK.shape
    g, n, _ = rhs_GNK.shape
    if rhs_GNK.shape[2] != k or k % MX_BLOCK:
        raise ValueError(f"K must match and be a multiple of 32: {lhs_MK.shape}, {rhs_GNK.shape}")
    if lhs_scales.shape != (m, k // MX_BLOCK) or rhs_scales.shape != (g, n, k // MX_BLOCK):
        raise ValueError("scales must be [M, K/32] and [G, N, K/32] uint8 E8M0 bytes")
    if group_sizes_G.shape != (g,):
        raise ValueError(f"group_sizes must be [{g}], got {group_sizes_G.shape}")
    if block_m % 64 or block_n % 8:
        raise ValueError("wgmma tiles need block_m % 64 == 0 and block_n % 8 == 0")
    group_sizes_G = group_sizes_G.astype(jnp.int32)
    dest, aligned_sizes, padded_rows = grouped_layout.aligned_destinations(
        group_sizes_G, m, block_m
    )
    pad_n = -n % block_n
    rhs_GNK = jnp.pad(rhs_GNK, ((0, 0), (0, pad_n), (0, 0)))
    rhs_sc = jnp.pad(_e8m0_to_f32(rhs_scales), ((0, 0), (0, pad_n), (0, 0)))
    lhs_sc = grouped_layout.to_aligned_rows(_e8m0_to_f32(lhs_scales), dest, padded_rows)
    out = _aligned_mxfp8_grouped_gemm(
        jnp.cumsum(aligned_sizes) // block_m,
        grouped_layout.to_aligned_rows(lhs_MK, dest, padded_rows),
        lhs_sc.T,
        rhs_GNK,
        jnp.swapaxes(rhs_sc, 1, 2),
        block_m=block_m,
        block_n=block_n,
        interpret=interpret,
    )
    return grouped_layout.from_aligned_rows(out, dest)[:, :n]
