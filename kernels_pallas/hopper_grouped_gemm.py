"""Hopper (wgmma) grouped GEMMs for the low-precision MoE op, in Pallas Mosaic GPU.

Contract (shared with the jnp reference in `grouped_layout`): rows of the LHS sorted by group,
rows of group g multiply the RHS of group g, rows past sum(group_sizes) are zero.

Hopper has no block-scaled MMA, so two kernels:
  `grouped_gemm`: bf16 operands, fed "codes times block scales" for NVFP4 (exact in bf16; Hopper
      has no fp4 MMA). Works straight on the sorted rows (`ragged_tiles` work units: no copy to
      an aligned layout, empty groups cost nothing, units past the last exit at once), a
      multi-stage TMA ring (`pipeline`), block sizes from `tiling` by shape class, and a fused
      epilogue: optional per-row and per-(group, column) float32 factors (the NVFP4 outer
      scales), the cast to the output dtype, and rows stored straight to their destinations.
      With `num_sms` the grid is persistent: that many CTAs loop over the (unit, N tile) pairs
      of the used units only, and a tile's stores overlap the next tile's K loop. One warpgroup
      issues both TMA and wgmma here; `hopper_warp_specialized` is the same GEMM with a
      producer warpgroup and two consumer warpgroups on 128 x 256 tiles.
  `mxfp8_grouped_gemm`: fp8 codes straight from memory; one fp8 wgmma per 32-wide scale block,
      its partial product promoted into the float32 accumulator times the row (token) scales and
      column scales of that block. Each M tile belongs to one group via a `block_m`-aligned
      copy of the rows (`grouped_layout`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import grouped_layout, mgpu_compat, pipeline, ragged_tiles, tiling

MX_BLOCK = 32


def _check(lhs_MK, rhs_GKN, group_sizes_G, row_scale_M, col_scale_GN) -> None:
    if lhs_MK.ndim != 2 or rhs_GKN.ndim != 3 or lhs_MK.shape[1] != rhs_GKN.shape[1]:
        raise ValueError(f"expected lhs [M, K], rhs [G, K, N]; got {lhs_MK.shape}, {rhs_GKN.shape}")
    num_groups, _, n = rhs_GKN.shape
    if group_sizes_G.shape != (num_groups,):
        raise ValueError(f"group_sizes must be [{num_groups}], got {group_sizes_G.shape}")
    if lhs_MK.dtype != jnp.bfloat16 or rhs_GKN.dtype != jnp.bfloat16:
        raise TypeError(f"operands must be bfloat16, got {lhs_MK.dtype} and {rhs_GKN.dtype}")
    if row_scale_M is not None and row_scale_M.shape != (lhs_MK.shape[0],):
        raise ValueError(f"row_scale must be [{lhs_MK.shape[0]}], got {row_scale_M.shape}")
    if col_scale_GN is not None and col_scale_GN.shape != (num_groups, n):
        raise ValueError(f"col_scale must be [{num_groups}, {n}], got {col_scale_GN.shape}")


def _ragged_kernel(
    units, used, lhs, rhs, row_scale, col_scale, *, m, tiles, out_dtype, num_ctas, interpret
):
    """out[m, N] = per unit, its tile of lhs times rhs[group], scaled, cast, rows stored.

    `num_ctas` None: one program per (unit slot, N tile). Otherwise persistent: `num_ctas`
    programs stride over the (unit, N tile) pairs of the `used` units; a tile's row stores then
    run while the next tile's K loop does (the staging tile is waited on only before reuse).
    """
    k = lhs.shape[1]
    n = rhs.shape[2]
    bm, bn, bk, stages = tiles.block_m, tiles.block_n, tiles.block_k, tiles.stages
    k_steps = k // bk

    def body(units_gmem, used_gmem, lhs_gmem, rhs_gmem, row_gmem, col_gmem, out_gmem, *scratch):
        if num_ctas is None:
            tile(jax.lax.axis_index("m"), jax.lax.axis_index("n"), units_gmem, lhs_gmem,
                 rhs_gmem, row_gmem, col_gmem, out_gmem, *scratch)  # fmt: skip
        else:

            @plgpu.nd_loop((used_gmem[0], n // bn), collective_axes="cta")
            def _(info):
                tile(*info.index, units_gmem, lhs_gmem, rhs_gmem, row_gmem, col_gmem, out_gmem,
                     *scratch)  # fmt: skip

        plgpu.wait_smem_to_gmem(0)

    def tile(u, ni, units_gmem, lhs_gmem, rhs_gmem, row_gmem, col_gmem, out_gmem, *scratch):
        lhs_smem, rhs_smem, out_smem, loaded = scratch
        group, block, first, count = ragged_tiles.read_unit(units_gmem, u, bm)
        n_slice = pl.ds(ni * bn, bn)

        @pl.when((count > 0) & (group >= 0))
        def _compute():
            rhs_group = rhs_gmem.at[jnp.maximum(group, 0)]

            def issue_loads(step, slot):
                k_slice = pl.ds(step * bk, bk)
                bar = loaded.at[slot]
                plgpu.copy_gmem_to_smem(
                    lhs_gmem.at[pl.ds(block * bm, bm), k_slice], lhs_smem.at[slot], bar
                )
                plgpu.copy_gmem_to_smem(rhs_group.at[k_slice, n_slice], rhs_smem.at[slot], bar)

            def accumulate(acc_ref):
                pipeline.wgmma_k_loop(
                    k_steps,
                    stages,
                    loaded,
                    issue_loads,
                    lambda slot: plgpu.wgmma(acc_ref, lhs_smem.at[slot], rhs_smem.at[slot]),
                )
                return acc_ref[...]

            acc = pl.run_scoped(accumulate, plgpu.ACC((bm, bn)))
            if row_gmem is not None:
                rows = mgpu_compat.load(
                    row_gmem.at[pl.ds(block * bm, bm)],
                    plgpu.Layout.WGMMA.reduce(1),
                    optimized=False,
                )
                acc = acc * jax.lax.broadcast_in_dim(rows, (bm, bn), [0])
            if col_gmem is not None:
                cols = mgpu_compat.load(
                    col_gmem.at[jnp.maximum(group, 0), n_slice],
                    plgpu.Layout.WGMMA.reduce(0),
                    optimized=False,
                )
                acc = acc * jax.lax.broadcast_in_dim(cols, (bm, bn), [1])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores read it
            out_smem[...] = acc.astype(out_dtype)

        @pl.when((count > 0) & (group < 0))
        def _zero_fill():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            out_smem[...] = jnp.zeros((bm, bn), out_dtype)

        @pl.when(count > 0)
        def _store():
            plgpu.commit_smem()
            ragged_tiles.store_rows(out_smem, out_gmem, block * bm, first, count, bm, n_slice)

    scratch = [
        plgpu.SMEM((stages, bm, bk), jnp.bfloat16),
        plgpu.SMEM((stages, bk, bn), jnp.bfloat16),
        plgpu.SMEM((bm, bn), out_dtype),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    ]
    args = [units, used, lhs, rhs, row_scale, col_scale]
    present = [a is not None for a in args]

    def kernel_body(*refs):
        refs = list(refs)
        full = [refs.pop(0) if p else None for p in present]
        return body(*full, *refs)

    if num_ctas is None:
        grid = dict(grid=(units.shape[1], n // bn), grid_names=("m", "n"))
    else:
        grid = dict(grid=(num_ctas,), grid_names=("cta",))
    kernel = plgpu.kernel(
        kernel_body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        scratch_types=scratch,
        **grid,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return kernel(*[a for a in args if a is not None])


@functools.partial(
    jax.jit,
    static_argnames=(
        "out_dtype",
        "block_m",
        "block_n",
        "block_k",
        "stages",
        "num_sms",
        "interpret",
    ),
)
def grouped_gemm(
    lhs_MK: jax.Array,
    rhs_GKN: jax.Array,
    group_sizes_G: jax.Array,
    row_scale_M: jax.Array | None = None,
    col_scale_GN: jax.Array | None = None,
    *,
    out_dtype=jnp.float32,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    stages: int | None = None,
    num_sms: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Grouped GEMM on Hopper tensor cores: out[r] = (lhs[r] @ rhs[g(r)]) * row[r] * col[g(r)].

    bf16 operands, float32 accumulation, factors (optional, float32) and the cast to `out_dtype`
    in the epilogue; rows past the groups are zero. Block sizes default to `tiling.hopper_tiles`
    for the shape; `num_sms` makes the grid persistent (at most that many CTAs, each looping over
    work units; H100/H200 have 132 SMs); `interpret` runs the kernel on CPU.
    """
    if num_sms is not None and num_sms < 1:
        raise ValueError(f"num_sms must be positive, got {num_sms}")
    _check(lhs_MK, rhs_GKN, group_sizes_G, row_scale_M, col_scale_GN)
    out_dtype = jnp.dtype(out_dtype)
    m, k = lhs_MK.shape
    num_groups, _, n = rhs_GKN.shape
    tiles = tiling.hopper_tiles(
        m,
        n,
        num_groups,
        out_dtype.itemsize,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        stages=stages,
    )
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    pad_k, pad_n = -k % bk, -n % bn  # zeros: the product is unchanged
    pad_m = -m % 8  # TMA reads of the swizzled LHS need whole 8-row groups in memory
    if pad_k or pad_m:
        lhs_MK = jnp.pad(lhs_MK, ((0, pad_m), (0, pad_k)))
    if pad_k or pad_n:
        rhs_GKN = jnp.pad(rhs_GKN, ((0, 0), (0, pad_k), (0, pad_n)))
    if row_scale_M is not None:  # the last tile reads a whole block of factors
        row_scale_M = jnp.pad(row_scale_M.astype(jnp.float32), (0, -m % bm))
    if col_scale_GN is not None:
        col_scale_GN = jnp.pad(col_scale_GN.astype(jnp.float32), ((0, 0), (0, pad_n)))
    units = ragged_tiles.work_units(group_sizes_G, m, bm)
    num_ctas = None
    if num_sms is not None:
        num_ctas = min(num_sms, units.shape[1] * (rhs_GKN.shape[2] // bn))
    out = _ragged_kernel(
        units,
        ragged_tiles.used_units(units),
        lhs_MK,
        rhs_GKN,
        row_scale_M,
        col_scale_GN,
        m=m,
        tiles=tiles,
        out_dtype=out_dtype,
        num_ctas=num_ctas,
        interpret=interpret,
    )
    return out[:, :n] if pad_n else out


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
            rows = mgpu_compat.load(lhs_sc_smem.at[0], plgpu.Layout.WGMMA.reduce(1))
            cols = mgpu_compat.load(rhs_sc_smem.at[0], plgpu.Layout.WGMMA.reduce(0))
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
