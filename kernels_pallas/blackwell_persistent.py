"""Persistent Blackwell block-scaled grouped GEMM: a fixed grid of CTAs looping over work units.

Same contract as `blackwell_grouped_gemm.grouped_gemm` (codes + block-scale bytes, RHS K-major
[G, N, K], optional NVFP4 factors and output cast fused in the epilogue, rows past the groups
zero). What differs is the schedule:

- Persistent: `num_sms` CTAs (or CTA pairs) are launched once; each loops over the (work unit,
  N tile) pairs `cta, cta + grid, ...` up to the number of *used* units, read from memory, so no
  CTA is launched for the unused tail of the static unit table. The TMA ring runs across tiles
  (step = tile * k_steps + ki), so loads of the next tile start while the last MMAs of this one
  run.
- Double-buffered TMEM accumulator: tile t accumulates into half t % 2 of TMEM; the epilogue
  warpgroup drains half t % 2 (TMEM -> registers -> factors, cast -> SMEM -> row-exact TMA
  stores) while the MMA warp already accumulates tile t + 1 into the other half. The MMA warp
  waits on `store_done[half]` (the epilogue of tile t - 2) before reusing a half.
- 2-CTA MMA (`collective=True`): a cluster of two CTAs computes a 256-row pair tile; each CTA
  loads its own 128 LHS rows and half of the RHS N tile (partitioned TMA copies tracked by the
  leader's barrier), the leader issues `tcgen05_mma(..., collective_axis)` which reads both
  CTAs' SMEM, so each CTA's SMEM traffic per output is 25% lower than with 128 x 128 tiles.
  Work units are then cut at 256 rows; each CTA stores the unit's rows that fall in its half.

Tiles are 128 (per CTA) x 128 in both modes: TMEM has 512 columns of 32 bits per lane, and two
128 x 256 float32 accumulators (512 columns) leave no room for the block scales the MMA reads
from TMEM, so a double-buffered 256-wide N tile cannot be expressed; the 2-CTA MMA of Mosaic GPU
also takes at most N = 128 per CTA. The epilogue uses two SMEM staging buffers of 128 x 64, one
TMA bulk group per chunk, and a read-only wait before a buffer is reused.

Numerics need Blackwell hardware (block-scaled tcgen05 cannot be interpreted): CPU tests lower it
for CUDA; the GPU check runs it against the float32 reference on a B200.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import blackwell_grouped_gemm as single
from kernels_pallas import grouped_layout, mgpu_compat, ragged_tiles, tiling

TILE_M = single.TILE_M  # rows per CTA
EPILOGUE_N = single.EPILOGUE_N
TMEM_COLUMNS = 512
DEFAULT_SMS = 148  # B200; pass the device's SM count when it differs
LOAD_WARP, MMA_WARP = 0, 1
MMA_WG, EPILOGUE_WG = 0, 1


def _scale_columns(rows: int, scales_per_row: int) -> int:
    """TMEM columns of a (rows, scales_per_row) scale matrix (4 bytes of a row per column)."""
    return -(-rows // 128) * scales_per_row


def persistent_tiles(
    n: int, dtype, out_itemsize: int = 4, *, collective=False, block_n=None, block_k=None,
    stages=None,
) -> tiling.Tiles:  # fmt: skip
    """Tiles of the persistent kernel; block_m is the rows of one unit (256 for a CTA pair)."""
    _, block = single.FORMATS[jnp.dtype(dtype)]
    bits = jnp.finfo(dtype).bits
    block_n = block_n or 128
    block_k = block_k or 128
    if block_n % 128 or block_k % (4 * block):
        raise ValueError(f"need block_n % 128 == 0 and block_k % {4 * block} == 0")
    k_scales = block_k // block
    tmem = 2 * block_n + _scale_columns(TILE_M, k_scales) + _scale_columns(block_n, k_scales)
    if tmem > TMEM_COLUMNS:
        raise ValueError(
            f"block_n={block_n}: two {TILE_M} x {block_n} float32 accumulators and the scales"
            f" need {tmem} TMEM columns, more than {TMEM_COLUMNS}"
        )
    if collective and block_n > 256:
        raise ValueError("a 2-CTA MMA takes at most N = 128 per CTA (block_n <= 256)")
    rhs_rows = block_n // 2 if collective else block_n  # RHS rows each CTA loads
    stage_bytes = (TILE_M + rhs_rows) * block_k * bits // 8 + (TILE_M + block_n) * k_scales
    epilogue_bytes = 2 * TILE_M * EPILOGUE_N * out_itemsize
    fits = (tiling.SMEM_BYTES - epilogue_bytes) // stage_bytes
    if fits < 2:
        raise ValueError(f"tiles need more than {tiling.SMEM_BYTES} bytes of SMEM")
    block_m = 2 * TILE_M if collective else TILE_M
    return tiling.Tiles(block_m, block_n, block_k, min(stages or 6, fits))


def _kernel(units, count, lhs, lhs_sc, rhs, rhs_sc, row, col, *, m, tiles, num_ctas, out_dtype):
    """out[m, N]; `num_ctas` programs (CTA pairs when tiles.block_m is 256) loop over the
    (unit, N tile) pairs of the first `count` units."""
    k, n = lhs.shape[1], rhs.shape[1]
    unit_m, block_n, block_k, stages = tiles.block_m, tiles.block_n, tiles.block_k, tiles.stages
    collective = unit_m == 2 * TILE_M
    axis = "x" if collective else None
    scale_dtype, block = single.FORMATS[jnp.dtype(lhs.dtype)]
    k_steps = k // block_k
    scale_cols = block_k // block // 4  # swizzled scale tiles per K step
    rhs_rows = block_n // 2 if collective else block_n
    transforms = single._operand_transforms(lhs.dtype, block_k)

    def copy_in(src, dst, bar, partitioned: bool):
        """A TMA load; in a CTA pair, split between the two CTAs (or replicated) and tracked by
        the leader's barrier."""
        if not collective:
            return plgpu.copy_gmem_to_smem(src, dst, bar)
        part = plgpu.CopyPartition.PARTITIONED(0) if partitioned else plgpu.CopyPartition.REPLICATED
        return plgpu.copy_gmem_to_smem(src, dst, bar, collective_axes=axis, leader_tracked=part)

    def body(units_gmem, count_gmem, a_gmem, a_sc_gmem, b_gmem, b_sc_gmem, row_gmem, col_gmem,
             out_gmem, *scratch):  # fmt: skip
        a_smem, b_smem, a_sc_smem, b_sc_smem, out_smem = scratch[:5]
        acc_tmem, a_sc_tmem, b_sc_tmem, loaded, consumed, mma_done, store_done = scratch[5:]
        wg = jax.lax.axis_index("wg")
        half = jax.lax.axis_index("x") if collective else jnp.int32(0)  # CTA within the pair

        @plgpu.nd_loop((count_gmem[0], n // block_n), collective_axes="cta")
        def _tile(info):
            u, ni = info.index
            tile = info.local_index  # MMA tiles come first, so this counts the MMA tiles before
            group, mi, first, rows = ragged_tiles.read_unit(units_gmem, u, unit_m)
            computes = group >= 0
            group = jnp.maximum(group, 0)
            acc_half = jax.lax.rem(tile, 2)
            acc = acc_tmem.at[:, pl.ds(acc_half * block_n, block_n)]

            @pl.when(computes & (wg == MMA_WG))
            def _loads_and_mmas():
                def per_warp(warp):
                    @pl.when(warp == LOAD_WARP)
                    def _load():
                        def step(ki, carry):
                            ring = tile * k_steps + ki
                            slot = jax.lax.rem(ring, stages)

                            @pl.when(ring >= stages)
                            def _():
                                plgpu.barrier_wait(consumed.at[slot])

                            k_slice = pl.ds(ki * block_k, block_k)
                            sc_slice = pl.ds(ki * scale_cols, scale_cols)
                            bar = loaded.at[slot]
                            copy_in(
                                a_gmem.at[pl.ds(mi * unit_m, unit_m), k_slice], a_smem.at[slot],
                                bar, True,
                            )  # fmt: skip
                            copy_in(
                                b_gmem.at[group, pl.ds(ni * block_n, block_n), k_slice],
                                b_smem.at[slot], bar, True,
                            )  # fmt: skip
                            copy_in(
                                a_sc_gmem.at[pl.ds(mi * (unit_m // 128), unit_m // 128), sc_slice],
                                a_sc_smem.at[slot], bar, True,
                            )  # fmt: skip
                            copy_in(
                                b_sc_gmem.at[group, pl.ds(ni * (block_n // 128), block_n // 128),
                                             sc_slice],
                                b_sc_smem.at[slot], bar, False,
                            )  # fmt: skip
                            return carry

                        jax.lax.fori_loop(0, k_steps, step, None)

                    @pl.when((warp == MMA_WARP) & (half == 0))
                    def _mma():
                        @pl.when(tile >= 2)
                        def _():  # the epilogue of tile - 2 has drained this half
                            plgpu.barrier_wait(store_done.at[acc_half])

                        def step(ki, carry):
                            slot = jax.lax.rem(tile * k_steps + ki, stages)
                            plgpu.barrier_wait(loaded.at[slot])
                            plgpu.async_copy_scales_to_tmem(a_sc_smem.at[slot], a_sc_tmem, axis)
                            plgpu.async_copy_scales_to_tmem(b_sc_smem.at[slot], b_sc_tmem, axis)
                            plgpu.tcgen05_mma(
                                acc,
                                a_smem.at[slot],
                                mgpu_compat.transposed(b_smem.at[slot]),
                                consumed.at[slot],
                                a_scale=a_sc_tmem,
                                b_scale=b_sc_tmem,
                                accumulate=ki > 0,
                                collective_axis=axis,
                            )

                            @pl.when(ki == k_steps - 1)
                            def _():
                                plgpu.tcgen05_commit_arrive(mma_done.at[acc_half], axis)

                            return carry

                        jax.lax.fori_loop(0, k_steps, step, None)

                mgpu_compat.warp_map(per_warp)

            @pl.when(wg == EPILOGUE_WG)
            def _epilogue():
                lo, hi = ragged_tiles.cta_rows(first, rows, half, TILE_M)  # in this CTA's half
                row0 = mi * unit_m + half * TILE_M

                @pl.when(computes)
                def _():
                    plgpu.barrier_wait(mma_done.at[acc_half])

                for j in range(block_n // EPILOGUE_N):
                    staging = out_smem.at[j % 2]
                    cols = pl.ds(ni * block_n + j * EPILOGUE_N, EPILOGUE_N)
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # chunk j-2 left `staging`

                    @pl.when(computes)
                    def _scaled_chunk(j=j, staging=staging, cols=cols):
                        out = plgpu.async_load_tmem(acc.at[:, pl.ds(j * EPILOGUE_N, EPILOGUE_N)])
                        plgpu.wait_load_tmem()
                        if row_gmem is not None:
                            factors = mgpu_compat.load(
                                row_gmem.at[pl.ds(row0, TILE_M)],
                                plgpu.Layout.TCGEN05.reduce(1),
                                optimized=False,
                            )
                            out = out * jax.lax.broadcast_in_dim(factors, out.shape, [0])
                        if col_gmem is not None:
                            factors = mgpu_compat.load(
                                col_gmem.at[group, cols],
                                plgpu.Layout.TCGEN05.reduce(0),
                                optimized=False,
                            )
                            out = out * jax.lax.broadcast_in_dim(factors, out.shape, [1])
                        staging[...] = out.astype(out_dtype)

                    @pl.when(~computes)
                    def _zero_chunk(staging=staging):
                        staging[...] = plgpu.layout_cast(
                            jnp.zeros((TILE_M, EPILOGUE_N), out_dtype), plgpu.Layout.TCGEN05
                        )

                    plgpu.commit_smem()
                    ragged_tiles.store_rows(
                        staging, out_gmem, row0, lo, hi - lo, TILE_M, cols, commit_group=False
                    )
                    plgpu.commit_smem_to_gmem_group()

                @pl.when(computes)
                def _():  # every TMEM load of this half has completed (waited above)
                    plgpu.barrier_arrive(store_done.at[acc_half])

        @pl.when(wg == EPILOGUE_WG)
        def _():
            plgpu.wait_smem_to_gmem(0)

    tmem = functools.partial(plgpu.TMEM, collective=collective)
    if collective:
        store_done = plgpu.ClusterBarrier(
            collective_axes=("x",), num_arrivals=1, num_barriers=2, orders_tensor_core=True
        )
    else:
        store_done = plgpu.Barrier(num_arrivals=1, num_barriers=2, orders_tensor_core=True)
    scratch = [
        plgpu.SMEM((stages, TILE_M, block_k), lhs.dtype, transforms=transforms),
        plgpu.SMEM((stages, rhs_rows, block_k), rhs.dtype, transforms=transforms),
        plgpu.SMEM((stages, 1, scale_cols, 32, 16), scale_dtype),
        plgpu.SMEM((stages, block_n // 128, scale_cols, 32, 16), scale_dtype),
        plgpu.SMEM((2, TILE_M, EPILOGUE_N), out_dtype),
        tmem((TILE_M, 2 * block_n), jnp.float32),
        tmem((TILE_M, block_k // block), scale_dtype, layout=plgpu.TMEMLayout.SCALES_LAYOUT),
        tmem((block_n, block_k // block), scale_dtype, layout=plgpu.TMEMLayout.SCALES_LAYOUT),
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),
        plgpu.Barrier(num_barriers=stages, orders_tensor_core=True),
        plgpu.Barrier(num_barriers=2, orders_tensor_core=True),
        store_done,
    ]
    args = [units, count, lhs, lhs_sc, rhs, rhs_sc, row, col]
    present = [a is not None for a in args]

    def kernel_body(*refs):
        refs = list(refs)
        return body(*[refs.pop(0) if p else None for p in present], *refs)

    cluster = dict(cluster=(2,), cluster_names=("x",)) if collective else {}
    kernel = plgpu.kernel(
        kernel_body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=2,
        thread_name="wg",
        scratch_types=scratch,
        **cluster,
    )
    return kernel(*[a for a in args if a is not None])


@functools.partial(
    jax.jit,
    static_argnames=("out_dtype", "collective", "block_n", "block_k", "stages", "num_sms"),
)
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
    collective: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    stages: int | None = None,
    num_sms: int = DEFAULT_SMS,
) -> jax.Array:
    """Block-scaled grouped GEMM, persistent over work units; same results as
    `blackwell_grouped_gemm.grouped_gemm`. `collective` uses CTA pairs and 2-CTA MMAs; `num_sms`
    bounds the CTAs launched (one per SM)."""
    single._check_dtypes(lhs_MK, rhs_GNK)
    tiles = persistent_tiles(
        rhs_GNK.shape[1], lhs_MK.dtype, jnp.dtype(out_dtype).itemsize, collective=collective,
        block_n=block_n, block_k=block_k, stages=stages,
    )  # fmt: skip
    unit_m, block_n, block_k = tiles.block_m, tiles.block_n, tiles.block_k
    single._check(lhs_MK, lhs_scales, rhs_GNK, rhs_scales, group_sizes_G, block_n, block_k)
    scale_dtype, block = single.FORMATS[jnp.dtype(lhs_MK.dtype)]
    m, n = lhs_MK.shape[0], rhs_GNK.shape[1]
    num_groups = rhs_GNK.shape[0]
    if row_scale_M is not None and row_scale_M.shape != (m,):
        raise ValueError(f"row_scale must be [{m}], got {row_scale_M.shape}")
    if col_scale_GN is not None and col_scale_GN.shape != (num_groups, n):
        raise ValueError(f"col_scale must be [{num_groups}, {n}], got {col_scale_GN.shape}")
    if num_sms < 1:
        raise ValueError(f"num_sms must be positive, got {num_sms}")
    pad_m = -m % unit_m  # whole unit tiles of scales and factors; codes to whole 8-row groups
    lhs_MK = single._pad_to(single._pad_to(lhs_MK, 1, block_k), 0, 8)
    rhs_GNK = single._pad_to(single._pad_to(rhs_GNK, 2, block_k), 1, block_n)
    lhs_scales = jnp.pad(single._pad_to(lhs_scales, 1, block_k // block), ((0, pad_m), (0, 0)))
    rhs_scales = single._pad_to(single._pad_to(rhs_scales, 2, block_k // block), 1, block_n)
    lhs_sc = jax.lax.bitcast_convert_type(grouped_layout.swizzle_scales(lhs_scales), scale_dtype)
    rhs_sc = jax.lax.bitcast_convert_type(grouped_layout.swizzle_scales(rhs_scales), scale_dtype)
    if row_scale_M is not None:
        row_scale_M = jnp.pad(row_scale_M.astype(jnp.float32), (0, pad_m))
    if col_scale_GN is not None:
        col_scale_GN = single._pad_to(col_scale_GN.astype(jnp.float32), 1, block_n)
    units = ragged_tiles.work_units(group_sizes_G, m, unit_m)
    cta_per_unit = 2 if collective else 1
    max_tiles = units.shape[1] * (rhs_GNK.shape[1] // block_n)
    out = _kernel(
        units,
        ragged_tiles.used_units(units),
        lhs_MK,
        lhs_sc,
        rhs_GNK,
        rhs_sc,
        row_scale_M,
        col_scale_GN,
        m=m,
        tiles=tiles,
        num_ctas=max(1, min(num_sms // cta_per_unit, max_tiles)),
        out_dtype=jnp.dtype(out_dtype),
    )
    return out[:, :n]
