"""Blackwell block-scaled grouped GEMM (tcgen05 MMA with scales in TMEM), Pallas Mosaic GPU.

Operands are quantized codes plus block-scale bytes, both contracted along K:
  MXFP8: float8_e4m3fn codes, E8M0 scales per 32 values;
  NVFP4: float4_e2m1fn codes, E4M3 scales per 16 values.
The RHS is stored K-major per group, [G, N, K], as the FP4 tensor cores require. The result is
float32 sum_k codes * scales; the NVFP4 per-token / per-column FP32 factors are applied by the
caller (the MoE op, as an XLA-fused multiply after the kernel).

Pipeline per output tile (grid over M tiles x N tiles; every M tile lies in one group thanks to
the 128-aligned row layout of `grouped_layout`): warpgroup 0 is warp-specialised, warp 0 issuing
TMA loads of codes and scales into a ring of SMEM stages and warp 1 copying the scales to TMEM
and issuing the block-scaled MMAs into a TMEM accumulator; warpgroup 1 waits for the last MMA and
stores the accumulator.

Numerics of this kernel need Blackwell hardware: block-scaled tcgen05 MMAs cannot be interpreted
on CPU, so the tests only check that it lowers for CUDA and rejects bad inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import grouped_layout, mgpu_compat

TILE_M = 128  # the block-scaled MMA's M, and the row count of one scale tile
# value dtype -> (scale dtype, values per scale)
FORMATS = {
    jnp.dtype(jnp.float8_e4m3fn): (jnp.float8_e8m0fnu, 32),
    jnp.dtype(jnp.float4_e2m1fn): (jnp.float8_e4m3fn, 16),
}


def _decode_scales(scale_bytes: jax.Array, scale_dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(scale_bytes, scale_dtype).astype(jnp.float32)


def grouped_gemm_reference(lhs_MK, lhs_scales, rhs_GNK, rhs_scales, group_sizes_G) -> jax.Array:
    """Pure-jnp contract of `grouped_gemm` without the FP32 factors (scales as uint8 bytes)."""
    scale_dtype, block = FORMATS[jnp.dtype(lhs_MK.dtype)]
    lhs = lhs_MK.astype(jnp.float32) * jnp.repeat(_decode_scales(lhs_scales, scale_dtype), block, 1)
    rhs = rhs_GNK.astype(jnp.float32) * jnp.repeat(
        _decode_scales(rhs_scales, scale_dtype), block, 2
    )
    return grouped_layout.grouped_gemm_reference(lhs, jnp.swapaxes(rhs, 1, 2), group_sizes_G)


def _check(lhs_MK, lhs_scales, rhs_GNK, rhs_scales, group_sizes_G, block_n, block_k) -> None:
    if jnp.dtype(lhs_MK.dtype) not in FORMATS or lhs_MK.dtype != rhs_GNK.dtype:
        raise TypeError(
            "operands must both be float8_e4m3fn (MXFP8) or both float4_e2m1fn (NVFP4), got"
            f" {lhs_MK.dtype} and {rhs_GNK.dtype}"
        )
    if lhs_MK.ndim != 2 or rhs_GNK.ndim != 3 or lhs_MK.shape[1] != rhs_GNK.shape[2]:
        raise ValueError(f"expected lhs [M, K], rhs [G, N, K]; got {lhs_MK.shape}, {rhs_GNK.shape}")
    _, block = FORMATS[jnp.dtype(lhs_MK.dtype)]
    m, k = lhs_MK.shape
    g, n, _ = rhs_GNK.shape
    if lhs_scales.shape != (m, k // block) or rhs_scales.shape != (g, n, k // block):
        raise ValueError(
            f"scales must be [M, K/{block}] and [G, N, K/{block}] uint8, got {lhs_scales.shape}"
            f" and {rhs_scales.shape}"
        )
    if lhs_scales.dtype != jnp.uint8 or rhs_scales.dtype != jnp.uint8:
        raise TypeError("scales must be raw uint8 bytes")
    if group_sizes_G.shape != (g,):
        raise ValueError(f"group_sizes must be [{g}], got {group_sizes_G.shape}")
    if block_n % 128 or block_k % (4 * block):
        raise ValueError(f"need block_n % 128 == 0 and block_k % {4 * block} == 0")


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """Zero codes (or zero-byte scales) along `axis`: padding contributes nothing."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, -x.shape[axis] % multiple)
    return jnp.pad(x, widths)


def _operand_transforms(dtype, block_k: int):
    bits = jnp.finfo(dtype).bits
    swizzle = plgpu.find_swizzle(block_k * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def _aligned_kernel(tile_ends, lhs, lhs_sc, rhs, rhs_sc, *, block_n, block_k, stages):
    """out[P, N] float32 on the 128-aligned layout; scales already swizzled."""
    padded_rows, k = lhs.shape
    num_groups, n, _ = rhs.shape
    scale_dtype, block = FORMATS[jnp.dtype(lhs.dtype)]
    k_iters = k // block_k
    scale_cols = block_k // block // 4  # swizzled scale tiles per K step
    transforms = _operand_transforms(lhs.dtype, block_k)
    MMA_WARP, LOAD_WARP = 1, 0

    def body(tile_ends_gmem, a_gmem, a_sc_gmem, b_gmem, b_sc_gmem, out_gmem, *scratch):
        (a_smem, b_smem, a_sc_smem, b_sc_smem, out_smem, acc_tmem, a_sc_tmem, b_sc_tmem) = scratch[
            :8
        ]
        loaded, consumed, mma_done = scratch[8:]
        mi, ni = jax.lax.axis_index("m"), jax.lax.axis_index("n")
        group = jnp.int32(0)
        for g in range(num_groups - 1):
            group += (mi >= tile_ends_gmem[g]).astype(jnp.int32)
        m_slice = pl.ds(mi * TILE_M, TILE_M)
        n_slice = pl.ds(ni * block_n, block_n)
        n_tiles = pl.ds(ni * (block_n // 128), block_n // 128)

        @pl.when(jax.lax.axis_index("wg") == 0)
        def _producer_and_mma():
            def per_warp(warp):
                @pl.when(warp == LOAD_WARP)
                def _load():
                    def step(ki, carry):
                        slot = jax.lax.rem(ki, stages)

                        @pl.when(ki >= stages)
                        def _():
                            plgpu.barrier_wait(consumed.at[slot])

                        k_slice = pl.ds(ki * block_k, block_k)
                        sc_slice = pl.ds(ki * scale_cols, scale_cols)
                        bar = loaded.at[slot]
                        plgpu.copy_gmem_to_smem(a_gmem.at[m_slice, k_slice], a_smem.at[slot], bar)
                        plgpu.copy_gmem_to_smem(
                            b_gmem.at[group, n_slice, k_slice], b_smem.at[slot], bar
                        )
                        plgpu.copy_gmem_to_smem(
                            a_sc_gmem.at[pl.ds(mi, 1), sc_slice], a_sc_smem.at[slot], bar
                        )
                        plgpu.copy_gmem_to_smem(
                            b_sc_gmem.at[group, n_tiles, sc_slice], b_sc_smem.at[slot], bar
                        )
                        return carry

                    jax.lax.fori_loop(0, k_iters, step, None)

                @pl.when(warp == MMA_WARP)
                def _mma():
                    def step(ki, carry):
                        slot = jax.lax.rem(ki, stages)
                        plgpu.barrier_wait(loaded.at[slot])
                        plgpu.async_copy_scales_to_tmem(a_sc_smem.at[slot], a_sc_tmem)
                        plgpu.async_copy_scales_to_tmem(b_sc_smem.at[slot], b_sc_tmem)
                        plgpu.tcgen05_mma(
                            acc_tmem,
                            a_smem.at[slot],
                            mgpu_compat.transposed(b_smem.at[slot]),
                            consumed.at[slot],
                            a_scale=a_sc_tmem,
                            b_scale=b_sc_tmem,
                            accumulate=ki > 0,
                        )

                        @pl.when(ki == k_iters - 1)
                        def _():
                            plgpu.tcgen05_commit_arrive(mma_done)

                        return carry

                    jax.lax.fori_loop(0, k_iters, step, None)

            mgpu_compat.warp_map(per_warp)

        @pl.when(jax.lax.axis_index("wg") == 1)
        def _store():
            plgpu.barrier_wait(mma_done)
            out_smem[...] = plgpu.async_load_tmem(acc_tmem)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[m_slice, n_slice])
            plgpu.wait_smem_to_gmem(0)
            plgpu.wait_load_tmem()

    f32_transforms = _operand_transforms(jnp.float32, block_n)
    scratch = [
        plgpu.SMEM((stages, TILE_M, block_k), lhs.dtype, transforms=transforms),
        plgpu.SMEM((stages, block_n, block_k), rhs.dtype, transforms=transforms),
        plgpu.SMEM((stages, 1, scale_cols, 32, 16), scale_dtype),
        plgpu.SMEM((stages, block_n // 128, scale_cols, 32, 16), scale_dtype),
        plgpu.SMEM((TILE_M, block_n), jnp.float32, transforms=f32_transforms),
        plgpu.TMEM((TILE_M, block_n), jnp.float32),
        plgpu.TMEM((TILE_M, block_k // block), scale_dtype, layout=plgpu.TMEMLayout.SCALES_LAYOUT),
        plgpu.TMEM((block_n, block_k // block), scale_dtype, layout=plgpu.TMEMLayout.SCALES_LAYOUT),
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),
        plgpu.Barrier(num_barriers=stages, orders_tensor_core=True),
        plgpu.Barrier(orders_tensor_core=True),
    ]
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((padded_rows, n), jnp.float32),
        grid=(padded_rows // TILE_M, n // block_n),
        grid_names=("m", "n"),
        num_threads=2,
        thread_name="wg",
        scratch_types=scratch,
    )
    return kernel(tile_ends, lhs, lhs_sc, rhs, rhs_sc)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "stages"))
def grouped_gemm(
    lhs_MK: jax.Array,
    lhs_scales: jax.Array,
    rhs_GNK: jax.Array,
    rhs_scales: jax.Array,
    group_sizes_G: jax.Array,
    *,
    block_n: int = 128,
    block_k: int = 128,
    stages: int = 2,
) -> jax.Array:
    """float32 block-scaled grouped GEMM on Blackwell tensor cores.

    Rows of group g multiply rhs[g]^T; rows past the groups are zero. K and N are zero-padded to
    the tiles here; the NVFP4 FP32 factors are the caller's.
    """
    _check(lhs_MK, lhs_scales, rhs_GNK, rhs_scales, group_sizes_G, block_n, block_k)
    scale_dtype, block = FORMATS[jnp.dtype(lhs_MK.dtype)]
    group_sizes_G = group_sizes_G.astype(jnp.int32)
    m, n = lhs_MK.shape[0], rhs_GNK.shape[1]
    lhs_MK, rhs_GNK = _pad_to(lhs_MK, 1, block_k), _pad_to(_pad_to(rhs_GNK, 2, block_k), 1, block_n)
    lhs_scales = _pad_to(lhs_scales, 1, block_k // block)
    rhs_scales = _pad_to(_pad_to(rhs_scales, 2, block_k // block), 1, block_n)
    dest, aligned_sizes, padded_rows = grouped_layout.aligned_destinations(group_sizes_G, m, TILE_M)
    lhs = grouped_layout.to_aligned_rows(lhs_MK, dest, padded_rows)
    lhs_sc = grouped_layout.to_aligned_rows(lhs_scales, dest, padded_rows)
    lhs_sc = jax.lax.bitcast_convert_type(grouped_layout.swizzle_scales(lhs_sc), scale_dtype)
    rhs_sc = jax.lax.bitcast_convert_type(grouped_layout.swizzle_scales(rhs_scales), scale_dtype)
    out = _aligned_kernel(
        jnp.cumsum(aligned_sizes) // TILE_M,
        lhs,
        lhs_sc,
        rhs_GNK,
        rhs_sc,
        block_n=block_n,
        block_k=block_k,
        stages=stages,
    )
    return grouped_layout.from_aligned_rows(out, dest)[:, :n]
