"""Warp-specialised Hopper bf16 grouped GEMM: a producer warpgroup, two consumer warpgroups.

Same contract and work units as `hopper_grouped_gemm.grouped_gemm` (sorted rows, fused factors,
output cast, rows past the groups zero), with 128 x 256 CTA tiles: one warpgroup only issues the
TMA loads of the ring (and gives up registers), two consumer warpgroups each own a 128 x 128
float32 accumulator -- the two column halves of the tile -- and issue their wgmmas on the shared
LHS tile, so the tensor cores see two independent wgmma streams while the loads run ahead. The
pipeline is JAX's warp-specialised one (`plgpu.emit_pipeline_warp_specialized`); a consumer waits
for its wgmma before releasing a slot, so no refill can overwrite operands still being read.

Each consumer runs its own epilogue: factors, cast, and the unit's rows stored in 64-column
chunks through its own SMEM staging. One program per (unit slot, N tile); units past the last
and empty groups cost nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import hopper_grouped_gemm, mgpu_compat, ragged_tiles, tiling

CONSUMERS = 2
EPILOGUE_N = 64
MEMORY_REGISTERS = 40  # what the producer warpgroup keeps


def ws_tiles(out_itemsize: int, *, block_k=None, stages=None) -> tiling.Tiles:
    """128 x 256 CTA tiles (128 x 128 per consumer), K steps of 64, stages that fit."""
    block_m, block_n, block_k = 128, 256, block_k or 64
    if block_k % 64:
        raise ValueError(f"block_k must be a multiple of 64, got {block_k}")
    stage_bytes = 2 * (block_m * block_k + block_k * block_n)
    staging = CONSUMERS * block_m * EPILOGUE_N * out_itemsize
    fits = (tiling.SMEM_BYTES - staging) // stage_bytes
    if fits < 2:
        raise ValueError(f"block_k={block_k}: two stages do not fit in SMEM")
    return tiling.Tiles(block_m, block_n, block_k, min(stages or tiling.MAX_STAGES, fits))


def _transforms(cols: int):
    swizzle = plgpu.find_swizzle(cols * 16)
    return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def _ws_kernel(units, lhs, rhs, row_scale, col_scale, *, m, tiles, out_dtype, interpret):
    k, n = lhs.shape[1], rhs.shape[2]
    bm, bn, bk, stages = tiles.block_m, tiles.block_n, tiles.block_k, tiles.stages
    wg_n = bn // CONSUMERS

    def body(units_gmem, lhs_gmem, rhs_gmem, row_gmem, col_gmem, out_gmem, staging_smem):
        u, ni = jax.lax.axis_index("m"), jax.lax.axis_index("n")
        wg = jax.lax.axis_index("wg")
        group, block, first, count = ragged_tiles.read_unit(units_gmem, u, bm)
        computes = (count > 0) & (group >= 0)
        group = jnp.maximum(group, 0)
        wg_cols = pl.ds(wg * wg_n, wg_n)  # this consumer's half of the tile

        def store(acc):
            """Factors, cast, and the unit's rows stored, 64 columns at a time."""
            staging = staging_smem.at[wg]
            if row_gmem is not None:
                factors = mgpu_compat.load(
                    row_gmem.at[pl.ds(block * bm, bm)],
                    plgpu.Layout.WGMMA.reduce(1),
                    optimized=False,
                )
                acc = acc * jax.lax.broadcast_in_dim(factors, acc.shape, [0])
            for j in range(wg_n // EPILOGUE_N):
                cols = pl.ds(ni * bn + wg * wg_n + j * EPILOGUE_N, EPILOGUE_N)
                chunk = acc[:, j * EPILOGUE_N : (j + 1) * EPILOGUE_N]
                if col_gmem is not None:
                    factors = mgpu_compat.load(
                        col_gmem.at[group, cols], plgpu.Layout.WGMMA.reduce(0), optimized=False
                    )
                    chunk = chunk * jax.lax.broadcast_in_dim(factors, chunk.shape, [1])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk left `staging`
                staging[...] = chunk.astype(out_dtype)
                plgpu.commit_smem()
                ragged_tiles.store_rows(staging, out_gmem, block * bm, first, count, bm, cols)
            plgpu.wait_smem_to_gmem(0)

        def mma(_, lhs_smem, rhs_smem, acc_ref):
            plgpu.wgmma(acc_ref, lhs_smem, rhs_smem.at[:, wg_cols])
            plgpu.wgmma_wait(0)  # operands read before the pipeline releases the slot
            return acc_ref

        def compute_context(run_pipeline):
            def scope(acc_ref):
                run_pipeline(acc_ref)
                store(acc_ref[...])

            pl.run_scoped(scope, plgpu.ACC((bm, wg_n)))

        pipeline = plgpu.emit_pipeline_warp_specialized(
            mma,
            grid=(k // bk,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda ki: (0, ki), transforms=_transforms(bk)),
                plgpu.BlockSpec((bk, bn), lambda ki: (ki, 0), transforms=_transforms(bn)),
            ],
            wg_axis="wg",
            num_compute_wgs=CONSUMERS,
            max_concurrent_steps=stages,
            compute_context=compute_context,
        )

        @pl.when(computes)
        def _():
            pipeline(lhs_gmem.at[pl.ds(block * bm, bm)], rhs_gmem.at[group, :, pl.ds(ni * bn, bn)])

        @pl.when((count > 0) & ~computes & (wg < CONSUMERS))
        def _zero_fill():
            store(plgpu.layout_cast(jnp.zeros((bm, wg_n), jnp.float32), plgpu.Layout.WGMMA))

    args = [units, lhs, rhs, row_scale, col_scale]
    present = [a is not None for a in args]

    def kernel_body(*refs):
        refs = list(refs)
        return body(*[refs.pop(0) if p else None for p in present], *refs)

    kernel = plgpu.kernel(
        kernel_body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(units.shape[1], n // bn),
        grid_names=("m", "n"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        scratch_types=[plgpu.SMEM((CONSUMERS, bm, EPILOGUE_N), out_dtype)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return kernel(*[a for a in args if a is not None])


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_k", "stages", "interpret"))
def grouped_gemm(
    lhs_MK: jax.Array,
    rhs_GKN: jax.Array,
    group_sizes_G: jax.Array,
    row_scale_M: jax.Array | None = None,
    col_scale_GN: jax.Array | None = None,
    *,
    out_dtype=jnp.float32,
    block_k: int | None = None,
    stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`hopper_grouped_gemm.grouped_gemm` with a producer and two consumer warpgroups."""
    hopper_grouped_gemm._check(lhs_MK, rhs_GKN, group_sizes_G, row_scale_M, col_scale_GN)
    out_dtype = jnp.dtype(out_dtype)
    tiles = ws_tiles(out_dtype.itemsize, block_k=block_k, stages=stages)
    m, k = lhs_MK.shape
    n = rhs_GKN.shape[2]
    pad_k, pad_n = -k % tiles.block_k, -n % tiles.block_n  # zeros: the product is unchanged
    lhs_MK = jnp.pad(lhs_MK, ((0, -m % 8), (0, pad_k)))
    rhs_GKN = jnp.pad(rhs_GKN, ((0, 0), (0, pad_k), (0, pad_n)))
    if row_scale_M is not None:
        row_scale_M = jnp.pad(row_scale_M.astype(jnp.float32), (0, -m % tiles.block_m))
    if col_scale_GN is not None:
        col_scale_GN = jnp.pad(col_scale_GN.astype(jnp.float32), ((0, 0), (0, pad_n)))
    out = _ws_kernel(
        ragged_tiles.work_units(group_sizes_G, m, tiles.block_m),
        lhs_MK,
        rhs_GKN,
        row_scale_M,
        col_scale_GN,
        m=m,
        tiles=tiles,
        out_dtype=out_dtype,
        interpret=interpret,
    )
    return out[:, :n]
