"""Hopper wgmma grouped GEMMs against the jnp reference: compiled on a GPU, interpreted on CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.quant import formats
from composer_jax.quant.moe_gemm import quantized_expert_gemm
from kernels_pallas import grouped_layout
from kernels_pallas import hopper_grouped_gemm as hopper
from tests.kernels import lowered_mosaic


def _random_groups(rng, num_rows, num_groups):
    """Ragged sizes with at least one empty group; some rows may be left past the groups."""
    cuts = np.sort(rng.integers(0, num_rows + 1, num_groups))
    sizes = np.diff(np.concatenate([[0], cuts])).astype(np.int32)
    sizes[rng.integers(num_groups)] = 0
    return jnp.asarray(sizes)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, k, n, g, tiles",
    [
        (100, 128, 64, 4, {}),  # the table's choice
        (40, 64, 48, 3, {}),  # N padded to the tile
        (301, 200, 128, 5, dict(block_m=128, block_n=128, stages=4)),  # M % 8 != 0, K padded
        (256, 256, 256, 6, dict(block_m=64, block_n=256, stages=3)),
        (130, 192, 128, 2, dict(block_m=64, block_n=64, stages=2)),
    ],
)
def test_matches_reference(m, k, n, g, tiles, interpret):
    rng = np.random.default_rng()  # fresh inputs on every run
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
    sizes = _random_groups(rng, m, g)
    out = hopper.grouped_gemm(lhs, rhs, sizes, interpret=interpret, **tiles)
    want = grouped_layout.grouped_gemm_reference(lhs, rhs, sizes)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4 * np.abs(want).max(), err_msg=sizes)
    assert (np.asarray(out)[int(sizes.sum()) :] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n, g", [(150, 128, 128, 4), (64, 64, 64, 1)])
def test_fused_epilogue_factors_and_cast(m, k, n, g, interpret):
    """Row and per-group column factors and the bf16 cast happen in the kernel's epilogue."""
    rng = np.random.default_rng()
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
    rows = jnp.asarray(np.exp(rng.uniform(-3, 3, m)), jnp.float32)
    cols = jnp.asarray(np.exp(rng.uniform(-3, 3, (g, n))), jnp.float32)
    sizes = _random_groups(rng, m, g)
    out = hopper.grouped_gemm(
        lhs, rhs, sizes, rows, cols, out_dtype=jnp.bfloat16, interpret=interpret
    )
    expert = grouped_layout.expert_of_row(sizes, m)
    want = grouped_layout.grouped_gemm_reference(lhs, rhs, sizes) * rows[:, None] * cols[expert]
    want = np.where(np.arange(m)[:, None] < int(sizes.sum()), want, 0)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(out, np.float32), want, rtol=1e-2, atol=1e-2 * np.abs(want).max()
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, k, n, g, num_sms, tiles",
    [
        (300, 192, 128, 5, 3, {}),  # several tiles per CTA, one empty group, rows past the groups
        (200, 128, 256, 4, 2, dict(block_m=64, block_n=256, stages=3)),
        (40, 64, 48, 6, 132, {}),  # more SMs than tiles; groups smaller than a tile
    ],
)
def test_persistent_grid_matches_reference(m, k, n, g, num_sms, tiles, interpret):
    """A fixed grid of CTAs looping over the used (unit, N tile) pairs, each tile's stores
    overlapping the next tile's K loop, with the fused factors and bf16 cast."""
    rng = np.random.default_rng()
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
    rows = jnp.asarray(np.exp(rng.uniform(-2, 2, m)), jnp.float32)
    cols = jnp.asarray(np.exp(rng.uniform(-2, 2, (g, n))), jnp.float32)
    sizes = _random_groups(rng, m, g)
    out = hopper.grouped_gemm(
        lhs, rhs, sizes, rows, cols, out_dtype=jnp.bfloat16, num_sms=num_sms, interpret=interpret,
        **tiles,
    )  # fmt: skip
    expert = grouped_layout.expert_of_row(sizes, m)
    want = grouped_layout.grouped_gemm_reference(lhs, rhs, sizes) * rows[:, None] * cols[expert]
    valid = int(sizes.sum())
    got = np.asarray(out, np.float32)
    np.testing.assert_allclose(
        got[:valid], want[:valid], rtol=1e-2, atol=1e-2 * np.abs(want).max(), err_msg=sizes
    )
    assert (got[valid:] == 0).all()


@pytest.mark.gpu
def test_all_groups_empty_gives_zeros(interpret):
    lhs = jnp.ones((70, 64), jnp.bfloat16)
    rhs = jnp.ones((3, 64, 64), jnp.bfloat16)
    out = hopper.grouped_gemm(lhs, rhs, jnp.zeros((3,), jnp.int32), interpret=interpret)
    assert (np.asarray(out) == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n, g", [(100, 64, 64, 3), (70, 96, 40, 4)])
def test_mxfp8_kernel_matches_reference(m, k, n, g, interpret):
    rng = np.random.default_rng()  # fresh inputs on every run
    scale_rows = np.exp2(rng.integers(-6, 6, (m, 1)))  # spread the E8M0 scales
    lhs = formats.quantize_mxfp8(jnp.asarray(rng.standard_normal((m, k)) * scale_rows, jnp.float32))
    rhs = formats.quantize_mxfp8(jnp.asarray(rng.standard_normal((g, n, k)), jnp.float32))
    sizes = _random_groups(rng, m, g)
    out = hopper.mxfp8_grouped_gemm(
        lhs.values, lhs.scales, rhs.values, rhs.scales, sizes, interpret=interpret
    )
    want = grouped_layout.grouped_gemm_reference(
        formats.dequantize(lhs), jnp.swapaxes(formats.dequantize(rhs), 1, 2), sizes
    )
    assert out.shape == (m, n) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=sizes)
    assert (np.asarray(out)[int(sizes.sum()) :] == 0).all()


def test_lowers_for_cuda_on_cpu():
    def lower(fn, *specs):
        return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()

    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    bf16 = (
        jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 256, 128), jnp.bfloat16),
    )
    assert "mosaic_gpu" in lower(hopper.grouped_gemm, *bf16, sizes)
    fp8 = (
        jax.ShapeDtypeStruct((300, 512), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((300, 16), jnp.uint8),
        jax.ShapeDtypeStruct((8, 256, 512), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((8, 256, 16), jnp.uint8),
    )
    assert "mosaic_gpu" in lower(hopper.mxfp8_grouped_gemm, *fp8, sizes)


def test_invalid_inputs_are_named():
    lhs, rhs = jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        hopper.grouped_gemm(lhs.astype(jnp.float32), rhs, jnp.array([4, 4]))
    with pytest.raises(ValueError, match="group_sizes"):
        hopper.grouped_gemm(lhs, rhs, jnp.array([8]))
    with pytest.raises(ValueError, match="block_m"):
        hopper.grouped_gemm(lhs, rhs, jnp.array([4, 4]), block_m=32)
    with pytest.raises(ValueError, match="num_sms"):
        hopper.grouped_gemm(lhs, rhs, jnp.array([4, 4]), num_sms=0)
    codes, scales = lhs.astype(jnp.float8_e4m3fn), jnp.zeros((8, 2), jnp.uint8)
    rhs_codes = jnp.zeros((2, 16, 64), jnp.float8_e4m3fn)
    rhs_scales = jnp.zeros((2, 16, 2), jnp.uint8)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        hopper.mxfp8_grouped_gemm(lhs, scales, rhs_codes, rhs_scales, jnp.array([4, 4]))
    with pytest.raises(ValueError, match="scales must be"):
        hopper.mxfp8_grouped_gemm(codes, scales[:, :1], rhs_codes, rhs_scales, jnp.array([4, 4]))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["mxfp8", "nvfp4_fwd_mxfp8_bwd"])
def test_quantized_op_with_hopper_backend_matches_reference_backend(precision):
    """Forward (fp8 kernel, or bf16 kernel with the NVFP4 factors fused), dgrad and the wgrad
    kernel, against the reference backend on the same quantized operands."""
    rng = np.random.default_rng()
    lhs = jnp.asarray(rng.standard_normal((40, 64)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((3, 64, 32)), jnp.bfloat16)
    sizes = jnp.array([20, 0, 12], jnp.int32)
    grad = jnp.asarray(rng.standard_normal((40, 32)), jnp.bfloat16)
    results = []
    for backend in ("reference", "pallas_hopper"):
        fn = lambda x, w: quantized_expert_gemm(x, w, sizes, precision, backend)  # noqa: B023
        out, vjp = jax.vjp(fn, lhs, rhs)
        results.append((out, *vjp(grad)))
    for a, b in zip(*results):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * np.abs(b).max())


@pytest.mark.gpu
def test_many_k_steps_match_reference(interpret):
    """Six K steps through a three-slot pipeline: every slot is refilled while wgmmas run."""
    rng = np.random.default_rng()
    m, k, n, g = 200, 384, 128, 4
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
    sizes = _random_groups(rng, m, g)
    out = hopper.grouped_gemm(lhs, rhs, sizes, block_k=64, interpret=interpret)
    want = grouped_layout.grouped_gemm_reference(lhs, rhs, sizes)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4 * np.abs(want).max(), err_msg=sizes)


@pytest.mark.parametrize("num_sms", [None, 132])
def test_pipeline_waits_for_the_previous_wgmma_before_refilling_its_slot(num_sms):
    """In the lowered kernel, the K loop waits on wgmma (<= 1 group left in flight) after its
    last wgmma and before any TMA load that refills a slot: the slot the load overwrites was read
    by the wgmma of the previous step (delay_release=1), which that wait has retired."""
    specs = (
        jax.ShapeDtypeStruct((256, 512), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 512, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((4,), jnp.int32),
    )
    kernel = functools.partial(hopper.grouped_gemm, num_sms=num_sms)
    lowered = jax.jit(kernel).trace(*specs).lower(lowering_platforms=("cuda",))
    loops = [
        events
        for module in lowered_mosaic.kernel_modules(lowered)
        for events in lowered_mosaic.loop_events(module, innermost=True)
    ]
    assert loops, "no K loop issuing wgmma found in the lowered kernel"
    for events in loops:
        kinds = [e.kind for e in events]
        last_mma = max(i for i, kind in enumerate(kinds) if kind == "mma")
        loads = [i for i, kind in enumerate(kinds) if kind == "tma_load"]
        assert loads, "the K loop refills no slot: not a pipeline"
        waits = [e.text for e in events[last_mma + 1 : min(loads)] if e.kind == "wait"]
        assert waits, f"no wgmma wait between the last wgmma and the refill: {kinds}"
        assert all(int(w.rstrip(";").split()[-1]) <= 1 for w in waits), waits
