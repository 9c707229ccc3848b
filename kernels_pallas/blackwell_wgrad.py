"""Blackwell MXFP8 weight-gradient grouped GEMM: out[g] = lhs_g^T @ grad_g, tokens contracted.

Both operands are MXFP8 along the token axis (E4M3 codes, one E8M0 scale per 32 tokens of a
column), as the MoE op's backward quantizes them, so the block-scaled tcgen05 MMA runs at the fp8
rate without dequantizing. The token axis is the MMA's K:

  A = lhs tile [tokens, K tile] read transposed (M-major; fp8 MMAs accept that, fp4 ones would
      not), its scales the (K, tokens/32) matrix;
  B = grad tile [tokens, N tile] as it lies (N-major), its scales the (N, tokens/32) matrix.

Scale matrices are swizzled into the tiles the tensor cores read (`grouped_layout`), whose K
dimension packs 4 scale blocks: so a token step is 128 rows and every group's rows start on a
128-row boundary (the expert-aligned layout of `grouped_layout`, zero rows in the gaps, which
quantize to zero codes and contribute nothing). One program per (group, K tile, N tile) runs a
dynamic number of token steps -- zero for an empty group, whose gradient is stored as zeros --
warp-specialised like the forward kernel: a TMA warp feeding a ring of SMEM stages, an MMA warp
copying the step's scales to TMEM and issuing the MMA, a second warpgroup storing the float32
tile in 64-column chunks.

Numerics need Blackwell hardware; CPU tests lower it for CUDA and check the wrapper's layout
against the dequantized reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import grouped_layout, mgpu_compat, tiling

TOKEN_STEP = 128  # tokens per MMA step: 4 scale blocks of 32, one swizzled scale tile wide
TILE_K = 128  # rows of the output tile (the MMA's M)
EPILOGUE_N = 64
MX_BLOCK = 32


def wgrad_tiles(n: int, *, block_n=None, stages=None) -> tiling.Tiles:
    """(K tile 128, N tile 128 or 256, token step 128, stages that fit beside the epilogue)."""
    block_n = block_n or (256 if n >= 256 else 128)
    if block_n not in (128, 256):
        raise ValueError(f"block_n must be 128 or 256, got {block_n}")
    scale_bytes = (TILE_K + block_n) * (TOKEN_STEP // MX_BLOCK)
    stage_bytes = (TILE_K + block_n) * TOKEN_STEP + scale_bytes
    fits = (tiling.SMEM_BYTES - 4 * TILE_K * EPILOGUE_N) // stage_bytes
    return tiling.Tiles(TILE_K, block_n, TOKEN_STEP, min(stages or 4, fits))


def _transforms(block_cols: int):
    swizzle = plgpu.find_swizzle(block_cols * 8)
    return (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))


def _wgrad_kernel(step_starts, steps, lhs, lhs_sc, grad, grad_sc, *, tiles):
    """out[G, K, N] float32; group g runs `steps[g]` token steps from step `step_starts[g]`."""
    k, n = lhs.shape[1], grad.shape[1]
    num_groups = steps.shape[0]
    block_n, stages = tiles.block_n, tiles.stages
    load_warp, mma_warp = 0, 1

    def body(starts_gmem, steps_gmem, a_gmem, a_sc_gmem, b_gmem, b_sc_gmem, out_gmem, *scratch):
        a_smem, b_smem, a_sc_smem, b_sc_smem, out_smem, acc_tmem, a_sc_tmem, b_sc_tmem = scratch[:8]
        loaded, consumed, mma_done = scratch[8:]
        g, ki, ni = (jax.lax.axis_index(a) for a in ("g", "k", "n"))
        first, count = starts_gmem[g], steps_gmem[g]
        k_slice = pl.ds(ki * TILE_K, TILE_K)
        n_slice = pl.ds(ni * block_n, block_n)

        @pl.when((count > 0) & (jax.lax.axis_index("wg") == 0))
        def _loads_and_mmas():
            def per_warp(warp):
                @pl.when(warp == load_warp)
                def _load():
                    def step(s, carry):
                        slot = jax.lax.rem(s, stages)

                        @pl.when(s >= stages)
                        def _():
                            plgpu.barrier_wait(consumed.at[slot])

                        tokens = pl.ds((first + s) * TOKEN_STEP, TOKEN_STEP)
                        bar = loaded.at[slot]
                        plgpu.copy_gmem_to_smem(a_gmem.at[tokens, k_slice], a_smem.at[slot], bar)
                        plgpu.copy_gmem_to_smem(b_gmem.at[tokens, n_slice], b_smem.at[slot], bar)
                        plgpu.copy_gmem_to_smem(
                            a_sc_gmem.at[pl.ds(ki, 1), pl.ds(first + s, 1)],
                            a_sc_smem.at[slot],
                            bar,
                        )
                        plgpu.copy_gmem_to_smem(
                            b_sc_gmem.at[pl.ds(ni * (block_n // 128), block_n // 128),
                                         pl.ds(first + s, 1)],
                            b_sc_smem.at[slot],
                            bar,
                        )  # fmt: skip
                        return carry

                    jax.lax.fori_loop(0, count, step, None)

                @pl.when(warp == mma_warp)
                def _mma():
                    def step(s, carry):
                        slot = jax.lax.rem(s, stages)
                        plgpu.barrier_wait(loaded.at[slot])
                        plgpu.async_copy_scales_to_tmem(a_sc_smem.at[slot], a_sc_tmem)
                        plgpu.async_copy_scales_to_tmem(b_sc_smem.at[slot], b_sc_tmem)
                        plgpu.tcgen05_mma(
                            acc_tmem,
                            mgpu_compat.transposed(a_smem.at[slot]),
                            b_smem.at[slot],
                            consumed.at[slot],
                            a_scale=a_sc_tmem,
                            b_scale=b_sc_tmem,
                            accumulate=s > 0,
                        )

                        @pl.when(s == count - 1)
                        def _():
                            plgpu.tcgen05_commit_arrive(mma_done)

                        return carry

                    jax.lax.fori_loop(0, count, step, None)

            mgpu_compat.warp_map(per_warp)

        @pl.when(jax.lax.axis_index("wg") == 1)
        def _epilogue():
            @pl.when(count > 0)
            def _():
                plgpu.barrier_wait(mma_done)

            for j in range(block_n // EPILOGUE_N):
                chunk = pl.ds(j * EPILOGUE_N, EPILOGUE_N)

                @pl.when(count > 0)
                def _product(chunk=chunk):
                    out_smem[...] = plgpu.async_load_tmem(acc_tmem.at[:, chunk])
                    plgpu.wait_load_tmem()

                @pl.when(count == 0)
                def _empty_group():
                    out_smem[...] = plgpu.layout_cast(
                        jnp.zeros((TILE_K, EPILOGUE_N), jnp.float32), plgpu.Layout.TCGEN05
                    )

                plgpu.commit_smem()
                cols = pl.ds(ni * block_n + j * EPILOGUE_N, EPILOGUE_N)
                plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[g, k_slice, cols])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.wait_smem_to_gmem(0)

    e8m0 = jnp.float8_e8m0fnu
    scratch = [
        plgpu.SMEM((stages, TOKEN_STEP, TILE_K), lhs.dtype, transforms=_transforms(TILE_K)),
        plgpu.SMEM((stages, TOKEN_STEP, block_n), grad.dtype, transforms=_transforms(block_n)),
        plgpu.SMEM((stages, 1, 1, 32, 16), e8m0),
        plgpu.SMEM((stages, block_n // 128, 1, 32, 16), e8m0),
        plgpu.SMEM((TILE_K, EPILOGUE_N), jnp.float32),
        plgpu.TMEM((TILE_K, block_n), jnp.float32),
        plgpu.TMEM((TILE_K, TOKEN_STEP // MX_BLOCK), e8m0, layout=plgpu.TMEMLayout.SCALES_LAYOUT),
        plgpu.TMEM((block_n, TOKEN_STEP // MX_BLOCK), e8m0, layout=plgpu.TMEMLayout.SCALES_LAYOUT),
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),
        plgpu.Barrier(num_barriers=stages, orders_tensor_core=True),
        plgpu.Barrier(orders_tensor_core=True),
    ]
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_groups, k, n), jnp.float32),
        grid=(num_groups, k // TILE_K, n // block_n),
        grid_names=("g", "k", "n"),
        num_threads=2,
        thread_name="wg",
        scratch_types=scratch,
    )
    return kernel(step_starts, steps, lhs, lhs_sc, grad, grad_sc)


def _check(lhs, lhs_scales, grad, grad_scales, sizes) -> None:
    if lhs.dtype != jnp.float8_e4m3fn or grad.dtype != jnp.float8_e4m3fn:
        raise TypeError(f"codes must be float8_e4m3fn, got {lhs.dtype} and {grad.dtype}")
    if lhs.ndim != 2 or grad.ndim != 2 or lhs.shape[0] != grad.shape[0]:
        raise ValueError(f"expected lhs [P, K] and grad [P, N]; got {lhs.shape}, {grad.shape}")
    rows = lhs.shape[0]
    if rows % TOKEN_STEP:
        raise ValueError(f"rows must be a multiple of {TOKEN_STEP} (aligned layout), got {rows}")
    want = ((rows // MX_BLOCK, lhs.shape[1]), (rows // MX_BLOCK, grad.shape[1]))
    if (lhs_scales.shape, grad_scales.shape) != want:
        raise ValueError(f"scales must be {want[0]} and {want[1]} (per 32 tokens), got"
                         f" {lhs_scales.shape} and {grad_scales.shape}")  # fmt: skip
    if lhs_scales.dtype != jnp.uint8 or grad_scales.dtype != jnp.uint8:
        raise TypeError("scales must be raw uint8 E8M0 bytes")
    if sizes.ndim != 1:
        raise ValueError(f"group_sizes must be one-dimensional, got {sizes.shape}")


def _pad_cols(x: jax.Array, multiple: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (0, -x.shape[1] % multiple)))


def kernel_operands(lhs_PK, lhs_scales, grad_PN, grad_scales, aligned_sizes_G, tiles):
    """What the kernel reads: (first token step and step count per group, lhs codes, lhs scale
    tiles, grad codes, grad scale tiles), K and N zero-padded to the tiles; a scale matrix has
    the MMA's K (tokens / 32) last and is swizzled: (cols / 128, P / 128, 32, 16) E8M0."""
    lhs_PK, lhs_scales = _pad_cols(lhs_PK, TILE_K), _pad_cols(lhs_scales, TILE_K)
    grad_PN, grad_scales = _pad_cols(grad_PN, tiles.block_n), _pad_cols(grad_scales, tiles.block_n)
    as_e8m0 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.float8_e8m0fnu)
    lhs_sc = as_e8m0(grouped_layout.swizzle_scales(lhs_scales.T))
    grad_sc = as_e8m0(grouped_layout.swizzle_scales(grad_scales.T))
    steps = aligned_sizes_G.astype(jnp.int32) // TOKEN_STEP
    return jnp.cumsum(steps) - steps, steps, lhs_PK, lhs_sc, grad_PN, grad_sc


@functools.partial(jax.jit, static_argnames=("block_n", "stages"))
def aligned_grouped_wgrad(
    lhs_PK: jax.Array,
    lhs_scales: jax.Array,
    grad_PN: jax.Array,
    grad_scales: jax.Array,
    aligned_sizes_G: jax.Array,
    *,
    block_n: int | None = None,
    stages: int | None = None,
) -> jax.Array:
    """float32 [G, K, N] = per group, lhs^T grad of MXFP8 operands blocked along the tokens.

    Rows are in the aligned layout: group sizes multiples of 128, groups back to back from row 0
    (`grouped_layout.aligned_destinations(..., 128)`); scales are [P/32, K] and [P/32, N] bytes.
    """
    _check(lhs_PK, lhs_scales, grad_PN, grad_scales, aligned_sizes_G)
    k, n = lhs_PK.shape[1], grad_PN.shape[1]
    tiles = wgrad_tiles(n, block_n=block_n, stages=stages)
    operands = kernel_operands(lhs_PK, lhs_scales, grad_PN, grad_scales, aligned_sizes_G, tiles)
    return _wgrad_kernel(*operands, tiles=tiles)[:, :k, :n]


def aligned_wgrad_reference(lhs_PK, lhs_scales, grad_PN, grad_scales, aligned_sizes_G):
    """float32 contract of `aligned_grouped_wgrad`: dequantize, then XLA's ragged_dot_general."""

    def dequantize(codes, scale_bytes):
        scales = jax.lax.bitcast_convert_type(scale_bytes, jnp.float8_e8m0fnu).astype(jnp.float32)
        return codes.astype(jnp.float32) * jnp.repeat(scales, MX_BLOCK, axis=0)

    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return jax.lax.ragged_dot_general(
        dequantize(lhs_PK, lhs_scales),
        dequantize(grad_PN, grad_scales),
        aligned_sizes_G.astype(jnp.int32),
        numbers,
        preferred_element_type=jnp.float32,
    )
