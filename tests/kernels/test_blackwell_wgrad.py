"""Blackwell MXFP8 wgrad kernel: lowers for CUDA on CPU; what it reads, replayed on the host.

The MMAs need Blackwell hardware. On CPU: the kernel lowers at ragged shapes, and a host replay
of its loop -- the same token steps, the same slices of the swizzled scale tiles, the block-scaled
product per step -- over the operands the wrapper prepares matches the dequantized reference, so
the layout (scale orientation, swizzle, step offsets, padding) is right before any GPU runs it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.quant import formats, moe_gemm
from kernels_pallas import blackwell_wgrad as wgrad
from kernels_pallas import grouped_layout
from tests.kernels import lowered_mosaic


def _aligned_operands(rng, sizes, k, n):
    """MXFP8 (along tokens) codes and scales of random rows in the 128-aligned layout."""
    rows = int(sum(sizes))
    lhs = rng.standard_normal((rows, k)) * np.exp2(rng.integers(-4, 4, (1, k)))
    grad = rng.standard_normal((rows, n))
    dest, aligned, padded = grouped_layout.aligned_destinations(
        jnp.asarray(sizes, jnp.int32), rows, wgrad.TOKEN_STEP
    )
    lhs_q = formats.quantize_mxfp8(
        grouped_layout.to_aligned_rows(jnp.asarray(lhs, jnp.float32), dest, padded), axis=0
    )
    grad_q = formats.quantize_mxfp8(
        grouped_layout.to_aligned_rows(jnp.asarray(grad, jnp.float32), dest, padded), axis=0
    )
    return (lhs_q.values, lhs_q.scales, grad_q.values, grad_q.scales, aligned), (lhs, grad)


def _specs(p, k, n, g):
    s = jax.ShapeDtypeStruct
    fp8, u8 = jnp.float8_e4m3fn, jnp.uint8
    return (
        s((p, k), fp8),
        s((p // 32, k), u8),
        s((p, n), fp8),
        s((p // 32, n), u8),
        s((g,), jnp.int32),
    )


@pytest.mark.parametrize(
    "p, k, n, g, block_n",
    [(1024, 256, 512, 4, None), (512, 200, 130, 3, None), (2048, 7168 // 8, 384, 8, 128)],
)
def test_lowers_for_cuda(p, k, n, g, block_n):
    fn = functools.partial(wgrad.aligned_grouped_wgrad, block_n=block_n)
    lowered = jax.jit(fn).trace(*_specs(p, k, n, g)).lower(lowering_platforms=("cuda",))
    assert len(lowered_mosaic.kernel_modules(lowered)) == 1


def _unswizzled(tile_bytes) -> np.ndarray:
    """(rows, 4) float32 scales of swizzled (rows/128, 1, 32, 16) E8M0 tiles."""
    raw = jax.lax.bitcast_convert_type(jnp.asarray(tile_bytes), jnp.uint8)
    return np.exp2(np.asarray(grouped_layout.unswizzle_scales(raw), np.float64) - 127)


@pytest.mark.parametrize("sizes, k, n", [([128, 0, 256, 384], 256, 256), ([384, 128], 136, 72)])
def test_host_replay_of_the_kernel_loop_matches_the_reference(sizes, k, n):
    rng = np.random.default_rng()
    args, _ = _aligned_operands(rng, sizes, k, n)
    tiles = wgrad.wgrad_tiles(n)
    starts, steps, lhs, lhs_sc, grad, grad_sc = (
        np.asarray(x) if x.dtype != jnp.float8_e8m0fnu else x
        for x in wgrad.kernel_operands(*args, tiles)
    )
    lhs, grad = lhs.astype(np.float64), grad.astype(np.float64)
    bn, step = tiles.block_n, wgrad.TOKEN_STEP
    out = np.zeros((len(sizes), lhs.shape[1], grad.shape[1]))
    for g in range(len(sizes)):
        for ki in range(lhs.shape[1] // wgrad.TILE_K):
            for ni in range(grad.shape[1] // bn):
                k_cols = slice(ki * wgrad.TILE_K, (ki + 1) * wgrad.TILE_K)
                n_cols = slice(ni * bn, (ni + 1) * bn)
                for s in range(steps[g]):  # the kernel's slices, step by step
                    t = starts[g] + s
                    tokens = slice(t * step, (t + 1) * step)
                    a_scales = _unswizzled(lhs_sc[ki : ki + 1, t : t + 1])  # (128 K rows, 4)
                    b_scales = _unswizzled(
                        grad_sc[ni * bn // 128 : (ni + 1) * bn // 128, t : t + 1]
                    )
                    a = lhs[tokens, k_cols].T * np.repeat(a_scales, 32, axis=1)
                    b = grad[tokens, n_cols] * np.repeat(b_scales.T, 32, axis=0)
                    out[g, k_cols, n_cols] += a @ b
    want = np.asarray(wgrad.aligned_wgrad_reference(*args))
    np.testing.assert_allclose(out[:, :k, :n], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(want[np.asarray(sizes) == 0], 0)


def test_reference_equals_the_bf16_wgrad_of_the_dequantized_rows():
    """Aligning groups to 128 instead of 32 rows changes no scale block: same product."""
    rng = np.random.default_rng()
    sizes = np.array([70, 0, 33, 150])
    args, (lhs, grad) = _aligned_operands(rng, sizes, 64, 48)
    got = wgrad.aligned_wgrad_reference(*args)
    # The reference backend's layout: groups aligned to 32 rows.
    lhs32 = formats.dequantize(formats.quantize_mxfp8(_aligned32(lhs, sizes), axis=0))
    grad32 = formats.dequantize(formats.quantize_mxfp8(_aligned32(grad, sizes), axis=0))
    _, aligned, _ = grouped_layout.aligned_destinations(jnp.asarray(sizes), int(sizes.sum()), 32)
    numbers = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])
    want = jax.lax.ragged_dot_general(lhs32, grad32, aligned, numbers)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _aligned32(x, sizes):
    dest, _, padded = grouped_layout.aligned_destinations(jnp.asarray(sizes), x.shape[0], 32)
    return grouped_layout.to_aligned_rows(jnp.asarray(x, jnp.float32), dest, padded)


def test_quantized_op_backward_uses_the_wgrad_kernel_on_blackwell():
    def loss(lhs, rhs, sizes):
        out = moe_gemm._quantized_gemm(lhs, rhs, sizes, "nvfp4_fwd_mxfp8_bwd", "pallas_blackwell")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    specs = (
        jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 128, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    lowered = (
        jax.jit(jax.grad(loss, argnums=(0, 1))).trace(*specs).lower(lowering_platforms=("cuda",))
    )
    assert len(lowered_mosaic.kernel_modules(lowered)) == 3  # forward, dgrad, wgrad
    assert "ragged_dot" not in lowered.as_text()  # no XLA grouped GEMM left


def test_invalid_inputs_are_named():
    fp8 = jnp.zeros((128, 64), jnp.float8_e4m3fn)
    scales = jnp.zeros((4, 64), jnp.uint8)
    sizes = jnp.array([128], jnp.int32)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        wgrad.aligned_grouped_wgrad(fp8.astype(jnp.bfloat16), scales, fp8, scales, sizes)
    with pytest.raises(ValueError, match="multiple of 128"):
        wgrad.aligned_grouped_wgrad(fp8[:96], scales[:3], fp8[:96], scales[:3], sizes)
    with pytest.raises(ValueError, match="scales must be"):
        wgrad.aligned_grouped_wgrad(fp8, scales[:, :32], fp8, scales, sizes)
    with pytest.raises(TypeError, match="uint8"):
        wgrad.aligned_grouped_wgrad(fp8, scales.astype(jnp.int32), fp8, scales, sizes)
    with pytest.raises(ValueError, match="block_n"):
        wgrad.aligned_grouped_wgrad(fp8, scales, fp8, scales, sizes, block_n=64)
