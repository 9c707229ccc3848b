"""Blackwell block-scaled grouped GEMM (tcgen05 MMA with scales in TMEM), Pallas Mosaic GPU.

Operands are quantized codes plus block-scale bytes, both contracted along K:
  MXFP8: float8_e4m3fn codes, E8M0 scales per 32 values;
  NVFP4: float4_e2m1fn codes, E4M3 scales per 16 values.
The RHS is stored K-major per group, [G, N, K], as the FP4 tensor cores require.

Schedule: `ragged_tiles` work units over the sorted rows (no copy to an aligned layout; a
128-row tile straddling a group boundary is visited once per group, keeping that group's rows;
empty groups and units past the last cost nothing), grid (units, N tiles), block sizes from
`blackwell_tiles` (N tiles of 256 where N allows, 4-6 TMA stages). Per unit, warpgroup 0 is
warp-specialised, warp 0 issuing TMA loads of codes and scales into the ring of SMEM stages and
warp 1 copying the scales to TMEM and issuing the block-scaled MMAs into a TMEM accumulator;
warpgroup 1 waits for the last MMA and runs the epilogue in 64-column chunks: optional per-row
and per-(group, column) float32 factors (the NVFP4 outer scales), the cast to the output dtype,
and only the unit's rows stored.

The persistent variant (a fixed grid looping over the units, a double-buffered TMEM accumulator
so the epilogue of one tile overlaps the MMAs of the next, optional 2-CTA MMA) is
`blackwell_persistent`; this one keeps 256-wide N tiles, which a double buffer cannot hold.

Numerics of this kernel need Blackwell hardware: block-scaled tcgen05 MMAs cannot be interpreted
on CPU, so the tests only check that it lowers for CUDA and rejects bad inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import grouped_layout, mgpu_compat, ragged_tiles, tiling

TILE_M = 128  # the block-scaled MMA's M, and the row count of one scale tile
EPILOGUE_N = 64  # output columns staged through SMEM at a time
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


def _check_dtypes(lhs_MK, rhs_GNK) -> None:
    if jnp.dtype(lhs_MK.dtype) not in FORMATS or lhs_MK.dtype != rhs_GNK.dtype:
        raise TypeError(
            "operands must both be float8_e4m3fn (MXFP8) or both float4_e2m1fn (NVFP4), got"
            f" {lhs_MK.dtype} and {rhs_GNK.dtype}"
        )


def _check(lhs_MK, lhs_scales, rhs_GNK, rhs_scales, group_sizes_G, block_n, block_k) -> None:
    _check_dtypes(lhs_MK, rhs_GNK)
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


def _ragged_kernel(units, lhs, lhs_sc, rhs, rhs_sc, row, col, *, m, tiles, out_dtype):
    """out[m, N] per work unit: its 128-row tile of lhs times rhs[group] (block-scaled), scaled
    by the optional factors, cast, and the unit's rows stored; scales already swizzled."""
    k = lhs.shape[1]
    n = rhs.shape[1]
    block_n, block_k, stages = tiles.block_n, tiles.block_k, tiles.stages
    scale_dtype, block = FORMATS[jnp.dtype(lhs.dtype)]
    k_iters = k // block_k
    scale_cols = block_k // block // 4  # swizzled scale tiles per K step
    transforms = _operand_transforms(lhs.dtype, block_k)
    MMA_WARP, LOAD_WARP = 1, 0

    def body(units_gmem, a_gmem, a_sc_gmem, b_gmem, b_sc_gmem, row_gmem, col_gmem, out_gmem, *scr):
        (a_smem, b_smem, a_sc_smem, b_sc_smem, out_smem, acc_tmem, a_sc_tmem, b_sc_tmem) = scr[:8]
        loaded, consumed, mma_done = scr[8:]
        u, ni = jax.lax.axis_index("m"), jax.lax.axis_index("n")
        group, mi, first, count = ragged_tiles.read_unit(units_gmem, u, TILE_M)
        computes = (count > 0) & (group >= 0)
        group = jnp.maximum(group, 0)
        m_slice = pl.ds(mi * TILE_M, TILE_M)
        n_slice = pl.ds(ni * block_n, block_n)
        n_tiles = pl.ds(ni * (block_n // 128), block_n // 128)

        @pl.when(computes & (jax.lax.axis_index("wg") == 0))
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

        @pl.when((count > 0) & (jax.lax.axis_index("wg") == 1))
        def _epilogue():
            @pl.when(computes)
            def _():
                plgpu.barrier_wait(mma_done)

            # Column chunks keep the output staging small (the SMEM goes to pipeline stages).
            for j in range(block_n // EPILOGUE_N):
                chunk = pl.ds(j * EPILOGUE_N, EPILOGUE_N)

                @pl.when(computes)
                def _scaled_chunk(chunk=chunk, j=j):
                    acc = plgpu.async_load_tmem(acc_tmem.at[:, chunk])
                    plgpu.wait_load_tmem()
                    if row_gmem is not None:
                        rows = mgpu_compat.load(
                            row_gmem.at[m_slice],
                            plgpu.Layout.TCGEN05.reduce(1),
                            optimized=False,
                        )
                        acc = acc * jax.lax.broadcast_in_dim(rows, acc.shape, [0])
                    if col_gmem is not None:
                        cols = mgpu_compat.load(
                            col_gmem.at[group, pl.ds(ni * block_n + j * EPILOGUE_N, EPILOGUE_N)],
                            plgpu.Layout.TCGEN05.reduce(0),
                            optimized=False,
                        )
                        acc = acc * jax.lax.broadcast_in_dim(cols, acc.shape, [1])
                    out_smem[...] = acc.astype(out_dtype)

                @pl.when(~computes)
                def _zero_chunk():
                    out_smem[...] = plgpu.layout_cast(
                        jnp.zeros((TILE_M, EPILOGUE_N), out_dtype), plgpu.Layout.TCGEN05
                    )

                plgpu.commit_smem()
                cols_out = pl.ds(ni * block_n + j * EPILOGUE_N, EPILOGUE_N)
                ragged_tiles.store_rows(
                    out_smem, out_gmem, mi * TILE_M, first, count, TILE_M, cols_out
                )
                plgpu.wait_smem_to_gmem(0)

    scratch = [
        plgpu.SMEM((stages, TILE_M, block_k), lhs.dtype, transforms=transforms),
        plgpu.SMEM((stages, block_n, block_k), rhs.dtype, transforms=transforms),
        plgpu.SMEM((stages, 1, scale_cols, 32, 16), scale_dtype),
        plgpu.SMEM((stages, block_n // 128, scale_cols, 32, 16), scale_dtype),
        plgpu.SMEM((TILE_M, EPILOGUE_N), out_dtype),
        plgpu.TMEM((TILE_M, block_n), jnp.float32),
        plgpu.TMEM((TILE_M, block_k // block), scale_dtype, layout=plgpu.TMEMLayout.SCALES_LAYOUT),
        plgpu.TMEM((block_n, block_k // block), scale_dtype, layout=plgpu.TMEMLayout.SCALES_LAYOUT),
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),
        plgpu.Barrier(num_barriers=stages, orders_tensor_core=True),
        plgpu.Barrier(orders_tensor_core=True),
    ]
    args = [units, lhs, lhs_sc, rhs, rhs_sc, row, col]
    present = [a is not None for a in args]

    def kernel_body(*refs):
        refs = list(refs)
        return body(*[refs.pop(0) if p else None for p in present], *refs)

    kernel = plgpu.kernel(
        kernel_body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(units.shape[1], n // block_n),
        grid_names=("m", "n"),
        num_threads=2,
        thread_name="wg",
        scratch_types=scratch,
    )
    return kernel(*[a for a in args if a is not None])


def blackwell_tiles(
    n: int, dtype, out_itemsize: int = 4, *, block_n=None, block_k=None, stages=None
) -> tiling.Tiles:
    """Tiles by shape class: 256-wide N tiles when N allows (half the LHS traffic per FLOP), K
    steps of 128 codes, and as many stages (up to 6) as the SMEM left by the epilogue holds."""
    _, block = FORMATS[jnp.dtype(dtype)]
    bits = jnp.finfo(dtype).bits
    block_n = block_n or (256 if n >= 256 else 128)
    block_k = block_k or 128
    if block_n % 128 or block_n > 256 or block_k % (4 * block):
        raise ValueError(
            f"need block_n in (128, 256) and block_k % {4 * block} == 0, got {block_n}, {block_k}"
        )
    scale_bytes = (TILE_M + block_n) * (block_k // block)
    stage_bytes = (TILE_M + block_n) * block_k * bits // 8 + scale_bytes
    out_bytes = out_itemsize * TILE_M * EPILOGUE_N
    fits = (tiling.SMEM_BYTES - out_bytes) // stage_bytes
    if fits < 2:
        raise ValueError(f"tiles need more than {tiling.SMEM_BYTES} bytes of SMEM")
    return tiling.Tiles(TILE_M, block_n, block_k, min(stages or 6, fits))


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_n", "block_k", "stages"))
def grouped_gemm(
    lhs_MK: jax.Array,
    lhs_scales: jax.Array,
    rhs_GNK: jax.Array,
    rhs_scales: jax.Array,
    group_sizes_G: jax.Array,
    row_scale_M: jax.Array | None = None,
    col_scale_GN: jax.Array | None = None,
    *,
    out_dtype=jnp.float32,
    block_n: int | None = None,
    block_k: int | None = None,
    stages: int | None = None,
) -> jax.Array:
    """Block-scaled grouped GEMM on Blackwell tensor cores, on the sorted rows.

    out[r] = (sum_k codes x scales of lhs[r] and rhs[g(r)]) * row[r] * col[g(r)], the optional
    float32 factors (the NVFP4 outer scales) and the cast to `out_dtype` in the epilogue; rows
    past the groups are zero. K and N are zero-padded to the tiles here.
    """
    _check_dtypes(lhs_MK, rhs_GNK)
    tiles = blackwell_tiles(
        rhs_GNK.shape[1],
        lhs_MK.dtype,
        jnp.dtype(out_dtype).itemsize,
        block_n=block_n,
        block_k=block_k,
        stages=stages,
    )
    block_n, block_k = tiles.block_n, tiles.block_k
    _check(lhs_MK, lhs_scales, rhs_GNK, rhs_scales, group_sizes_G, block_n, block_k)
    scale_dtype, block = FORMATS[jnp.dtype(lhs_MK.dtype)]
    m, n = lhs_MK.shape[0], rhs_GNK.shape[1]
    if row_scale_M is not None and row_scale_M.shape != (m,):
        raise ValueError(f"row_scale must be [{m}], got {row_scale_M.shape}")
    if col_scale_GN is not None and col_scale_GN.shape != (rhs_GNK.shape[0], n):
        raise ValueError(f"col_scale must be [{rhs_GNK.shape[0]}, {n}], got {col_scale_GN.shape}")
    pad_m = -m % TILE_M  # whole 128-row scale tiles; codes only to whole 8-row TMA groups
    lhs_MK = _pad_to(_pad_to(lhs_MK, 1, block_k), 0, 8)
    rhs_GNK = _pad_to(_pad_to(rhs_GNK, 2, block_k), 1, block_n)
    lhs_scales = jnp.pad(_pad_to(lhs_scales, 1, block_k // block), ((0, pad_m), (0, 0)))
    rhs_scales = _pad_to(_pad_to(rhs_scales, 2, block_k // block), 1, block_n)
    lhs_sc = jax.lax.bitcast_convert_type(grouped_layout.swizzle_scales(lhs_scales), scale_dtype)
    rhs_sc = jax.lax.bitcast_convert_type(grouped_layout.swizzle_scales(rhs_scales), scale_dtype)
    if row_scale_M is not None:
        row_scale_M = jnp.pad(row_scale_M.astype(jnp.float32), (0, pad_m))
    if col_scale_GN is not None:
        col_scale_GN = _pad_to(col_scale_GN.astype(jnp.float32), 1, block_n)
    out = _ragged_kernel(
        ragged_tiles.work_units(group_sizes_G, m, TILE_M),
        lhs_MK,
        lhs_sc,
        rhs_GNK,
        rhs_sc,
        row_scale_M,
        col_scale_GN,
        m=m,
        tiles=tiles,
        out_dtype=jnp.dtype(out_dtype),
    )
    return out[:, :n]
