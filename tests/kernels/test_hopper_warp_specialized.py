"""Warp-specialised Hopper grouped GEMM (a producer and two consumer warpgroups) against the
jnp reference: compiled on a GPU, in Mosaic GPU interpret mode on CPU (which runs the three
warpgroups and their barriers)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import grouped_layout
from kernels_pallas import hopper_warp_specialized as ws
from tests.kernels import lowered_mosaic
from tests.kernels.test_hopper_grouped_gemm import _random_groups


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, k, n, g, tiles",
    [
        (300, 192, 256, 4, {}),  # ragged groups, one empty, rows past the groups
        (40, 64, 48, 6, {}),  # groups smaller than a tile, N padded to the 256-wide tile
        (130, 256, 512, 2, dict(stages=2)),  # two N tiles, K steps through a 2-slot ring
    ],
)
def test_matches_reference_with_fused_factors(m, k, n, g, tiles, interpret):
    rng = np.random.default_rng()  # fresh inputs on every run
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
    rows = jnp.asarray(np.exp(rng.uniform(-2, 2, m)), jnp.float32)
    cols = jnp.asarray(np.exp(rng.uniform(-2, 2, (g, n))), jnp.float32)
    sizes = _random_groups(rng, m, g)
    out = ws.grouped_gemm(
        lhs, rhs, sizes, rows, cols, out_dtype=jnp.bfloat16, interpret=interpret, **tiles
    )
    expert = grouped_layout.expert_of_row(sizes, m)
    want = grouped_layout.grouped_gemm_reference(lhs, rhs, sizes) * rows[:, None] * cols[expert]
    valid = int(sizes.sum())
    got = np.asarray(out, np.float32)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        got[:valid], want[:valid], rtol=1e-2, atol=1e-2 * np.abs(want).max(), err_msg=sizes
    )
    assert (got[valid:] == 0).all()


@pytest.mark.gpu
def test_float32_output_without_factors(interpret):
    rng = np.random.default_rng()
    lhs = jnp.asarray(rng.standard_normal((200, 128)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((3, 128, 256)), jnp.bfloat16)
    sizes = jnp.array([70, 0, 110], jnp.int32)
    out = ws.grouped_gemm(lhs, rhs, sizes, interpret=interpret)
    want = grouped_layout.grouped_gemm_reference(lhs, rhs, sizes)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())


def test_lowers_for_cuda_with_three_warpgroups():
    specs = (
        jax.ShapeDtypeStruct((1000, 512), jnp.bfloat16),
        jax.ShapeDtypeStruct((8, 512, 512), jnp.bfloat16),
        jax.ShapeDtypeStruct((8,), jnp.int32),
        jax.ShapeDtypeStruct((1000,), jnp.float32),
        jax.ShapeDtypeStruct((8, 512), jnp.float32),
    )
    kernel = functools.partial(ws.grouped_gemm, out_dtype=jnp.bfloat16)
    lowered = jax.jit(kernel).trace(*specs).lower(lowering_platforms=("cuda",))
    (module,) = lowered_mosaic.kernel_modules(lowered)
    assert "setmaxnreg" in str(module)  # the producer gives registers to the consumers


def test_tiles_and_invalid_inputs():
    assert ws.ws_tiles(2).stages == ws.ws_tiles(4).stages == 3  # 48 KB a stage + staging
    with pytest.raises(ValueError, match="block_k"):
        ws.ws_tiles(2, block_k=96)
    lhs, rhs = jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        ws.grouped_gemm(lhs.astype(jnp.float32), rhs, jnp.array([4, 4]))
    with pytest.raises(ValueError, match="group_sizes"):
        ws.grouped_gemm(lhs, rhs, jnp.array([8]))
