"""Hopper wgrad kernel (token axis contracted per group) against XLA's ragged_dot_general."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import hopper_wgrad as wgrad
from tests.kernels import lowered_mosaic
from tests.kernels.test_hopper_grouped_gemm import _random_groups


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, k, n, g, tiles",
    [
        (300, 128, 192, 4, {}),
        (130, 64, 48, 3, {}),  # N padded, K one tile
        (400, 256, 128, 2, dict(block_k=128, block_n=128, stages=3)),  # 4+ token steps a group
        (90, 100, 64, 5, dict(block_k=64, block_n=64, stages=2)),  # K padded
    ],
)
def test_matches_reference(m, k, n, g, tiles, interpret):
    rng = np.random.default_rng()  # fresh inputs on every run
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    grad = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    sizes = _random_groups(rng, m, g)  # ragged, one empty group, maybe rows past the groups
    out = wgrad.grouped_wgrad(lhs, grad, sizes, interpret=interpret, **tiles)
    want = wgrad.grouped_wgrad_reference(lhs, grad, sizes)
    assert out.shape == (g, k, n) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4 * np.abs(want).max(), err_msg=sizes)
    np.testing.assert_array_equal(np.asarray(out)[np.asarray(sizes) == 0], 0)


@pytest.mark.gpu
def test_aligned_entry_and_bf16_output(interpret):
    rng = np.random.default_rng()
    sizes = jnp.array([64, 0, 192], jnp.int32)  # already multiples of 64
    lhs = jnp.asarray(rng.standard_normal((256, 64)), jnp.bfloat16)
    grad = jnp.asarray(rng.standard_normal((256, 64)), jnp.bfloat16)
    out = wgrad.aligned_grouped_wgrad(lhs, grad, sizes, out_dtype=jnp.bfloat16, interpret=interpret)
    want = wgrad.grouped_wgrad_reference(lhs, grad, sizes)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=1e-2, atol=0.1)


def test_lowers_for_cuda_with_the_wait_before_each_refill():
    spec = functools.partial(jax.ShapeDtypeStruct)
    lowered = (
        jax.jit(wgrad.grouped_wgrad)
        .trace(
            spec((2048, 512), jnp.bfloat16), spec((2048, 256), jnp.bfloat16), spec((8,), jnp.int32)
        )
        .lower(lowering_platforms=("cuda",))
    )
    loops = [
        events
        for module in lowered_mosaic.kernel_modules(lowered)
        for events in lowered_mosaic.loop_events(module)
    ]
    assert loops
    for events in loops:
        kinds = [e.kind for e in events]
        last_mma = max(i for i, kind in enumerate(kinds) if kind == "mma")
        first_load = kinds.index("tma_load")
        assert "wait" in kinds[last_mma:first_load], kinds


def test_invalid_inputs_are_named():
    lhs, grad = jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((64, 32), jnp.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        wgrad.grouped_wgrad(lhs.astype(jnp.float32), grad, jnp.array([64]))
    with pytest.raises(ValueError, match="grad"):
        wgrad.grouped_wgrad(lhs, grad[:32], jnp.array([64]))
    with pytest.raises(ValueError, match="block_t"):
        wgrad.aligned_grouped_wgrad(lhs, grad, jnp.array([64]), block_t=32)


def test_reference_matches_a_per_group_loop():
    rng = np.random.default_rng()
    lhs = rng.standard_normal((20, 8)).astype(np.float32)
    grad = rng.standard_normal((20, 4)).astype(np.float32)
    sizes = np.array([5, 0, 12])
    out = np.asarray(wgrad.grouped_wgrad_reference(lhs, grad, jnp.asarray(sizes)))
    ends = np.cumsum(sizes)
    for e, (start, end) in enumerate(zip(ends - sizes, ends)):
        np.testing.assert_allclose(out[e], lhs[start:end].T @ grad[start:end], rtol=1e-5, atol=1e-5)
