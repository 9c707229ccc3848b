"""Blackwell block-scaled grouped GEMM: lowers for CUDA on CPU; layout and contract checks.

Its numerics need Blackwell hardware (block-scaled tcgen05 MMAs cannot be interpreted).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.quant import formats, moe_gemm
from kernels_pallas import blackwell_grouped_gemm as blackwell
from kernels_pallas import grouped_layout

FORMATS = {"mxfp8": (jnp.float8_e4m3fn, 32), "nvfp4": (jnp.float4_e2m1fn, 16)}


def _specs(fmt, m, k, n, g):
    dtype, block = FORMATS[fmt]
    return (
        jax.ShapeDtypeStruct((m, k), dtype),
        jax.ShapeDtypeStruct((m, k // block), jnp.uint8),
        jax.ShapeDtypeStruct((g, n, k), dtype),
        jax.ShapeDtypeStruct((g, n, k // block), jnp.uint8),
        jax.ShapeDtypeStruct((g,), jnp.int32),
    )


def _lower(fn, *specs):
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize(
    "m, k, n, g", [(300, 256, 256, 4), (128, 128, 128, 1), (1000, 512, 384, 8)]
)
def test_lowers_for_cuda(fmt, m, k, n, g):
    assert "mosaic_gpu" in _lower(blackwell.grouped_gemm, *_specs(fmt, m, k, n, g))


def test_lowers_through_the_jax_0_11_warp_map_spelling(monkeypatch):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    monkeypatch.delattr(plgpu, "warp_map", raising=False)  # JAX 0.11 has only core_map
    assert "mosaic_gpu" in _lower(blackwell.grouped_gemm, *_specs("mxfp8", 136, 128, 128, 2))


def test_lowers_with_other_tiles_and_padding():
    kernel = functools.partial(blackwell.grouped_gemm, block_n=128, block_k=256, stages=3)
    assert "mosaic_gpu" in _lower(kernel, *_specs("nvfp4", 200, 96, 200, 3))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("block_n", [128, 256])
def test_lowers_with_fused_factors_and_bf16_output(fmt, block_n):
    m, k, n, g = 1000, 512, 512, 8
    factors = (jax.ShapeDtypeStruct((m,), jnp.float32), jax.ShapeDtypeStruct((g, n), jnp.float32))
    kernel = functools.partial(blackwell.grouped_gemm, out_dtype=jnp.bfloat16, block_n=block_n)
    assert "mosaic_gpu" in _lower(kernel, *_specs(fmt, m, k, n, g), *factors)


def test_tile_table():
    fp8 = blackwell.blackwell_tiles(2048, jnp.float8_e4m3fn, out_itemsize=2)
    fp4 = blackwell.blackwell_tiles(2048, jnp.float4_e2m1fn, out_itemsize=2)
    assert (fp8.block_n, fp8.block_k, fp4.block_n, fp4.block_k) == (256, 128, 256, 128)
    assert (fp8.stages, fp4.stages) == (4, 6)  # 50 KB and 27 KB a stage
    assert blackwell.blackwell_tiles(128, jnp.float8_e4m3fn).block_n == 128
    with pytest.raises(ValueError, match="block_n"):
        blackwell.blackwell_tiles(2048, jnp.float8_e4m3fn, block_n=384)


@pytest.mark.parametrize("precision", moe_gemm.PRECISIONS)
def test_quantized_op_forward_and_backward_lower_with_blackwell_backend(precision):
    def loss(lhs, rhs, sizes):
        out = moe_gemm._quantized_gemm(lhs, rhs, sizes, precision, "pallas_blackwell")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    specs = (
        jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 128, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    text = _lower(jax.grad(loss, argnums=(0, 1)), *specs)
    assert text.count("mosaic_gpu") >= 2  # forward and dgrad kernels


def test_invalid_inputs_are_named():
    dtype, _ = FORMATS["mxfp8"]
    lhs, lhs_sc = jnp.zeros((128, 128), dtype), jnp.zeros((128, 4), jnp.uint8)
    rhs, rhs_sc = jnp.zeros((2, 128, 128), dtype), jnp.zeros((2, 128, 4), jnp.uint8)
    sizes = jnp.array([64, 64], jnp.int32)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        blackwell.grouped_gemm(lhs.astype(jnp.bfloat16), lhs_sc, rhs, rhs_sc, sizes)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        blackwell.grouped_gemm(lhs, lhs_sc, rhs.astype(jnp.float4_e2m1fn), rhs_sc, sizes)
    with pytest.raises(ValueError, match="scales must be"):
        blackwell.grouped_gemm(lhs, lhs_sc[:, :2], rhs, rhs_sc, sizes)
    with pytest.raises(TypeError, match="uint8"):
        blackwell.grouped_gemm(lhs, lhs_sc.astype(jnp.int32), rhs, rhs_sc, sizes)
    with pytest.raises(ValueError, match="group_sizes"):
        blackwell.grouped_gemm(lhs, lhs_sc, rhs, rhs_sc, sizes[:1])
    with pytest.raises(ValueError, match="block_n"):
        blackwell.grouped_gemm(lhs, lhs_sc, rhs, rhs_sc, sizes, block_n=64)
    with pytest.raises(ValueError, match=r"lhs \[M, K\]"):
        blackwell.grouped_gemm(lhs[:, :64], lhs_sc, rhs, rhs_sc, sizes)


def test_scale_swizzle_layout():
    scales = jnp.arange(2 * 256 * 8, dtype=jnp.int32).reshape(2, 256, 8)
    tiles = grouped_layout.swizzle_scales(scales)
    assert tiles.shape == (2, 2, 2, 32, 16)
    # Row 128 + 32*j + i, column 4*c + t sits at [1, c, i, 4*j + t].
    g, j, i, c, t = 1, 2, 5, 1, 3
    assert tiles[g, 1, c, i, 4 * j + t] == scales[g, 128 + 32 * j + i, 4 * c + t]
    np.testing.assert_array_equal(grouped_layout.unswizzle_scales(tiles), scales)
    with pytest.raises(ValueError, match="multiple"):
        grouped_layout.swizzle_scales(jnp.zeros((100, 8)))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_reference_contract_matches_format_dequantization(fmt, fresh_rng):
    rng = fresh_rng
    lhs = jnp.asarray(rng.standard_normal((50, 64)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 64, 32)), jnp.float32)
    sizes = jnp.array([20, 0, 25], jnp.int32)
    if fmt == "mxfp8":
        lhs_q, rhs_q = formats.quantize_mxfp8(lhs), formats.quantize_mxfp8(rhs, axis=1)
        lhs_dq, rhs_dq = formats.dequantize(lhs_q), formats.dequantize(rhs_q)
    else:
        lhs_q, rhs_q = formats.quantize_nvfp4(lhs), formats.quantize_nvfp4(rhs, axis=1)
        lhs_dq = formats.dequantize_nvfp4_unscaled(lhs_q)
        rhs_dq = formats.dequantize_nvfp4_unscaled(rhs_q)
    out = blackwell.grouped_gemm_reference(
        lhs_q.values,
        lhs_q.scales,
        jnp.swapaxes(rhs_q.values, 1, 2),
        jnp.swapaxes(rhs_q.scales, 1, 2),
        sizes,
    )
    want = grouped_layout.grouped_gemm_reference(lhs_dq, rhs_dq, sizes)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-5)
