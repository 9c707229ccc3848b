"""The claim scripts' numerics: the Gaussian k1 / k3 spread formulas against Monte Carlo where
sampling is reliable, and the per-tensor NVFP4 variant against the package's per-token format."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.quant import formats
from experiments import nvfp4_global_scale, rl_objective_figures


def test_gaussian_spread_formulas_match_monte_carlo():
    rows = rl_objective_figures.gaussian_spread(400_000, means=(0.3, 0.7, 1.0))
    for row in rows:
        assert row["kl"] == pytest.approx(row["mu"] ** 2 / 2)
        assert row["k1_mc_mean"] == pytest.approx(row["kl"], abs=0.01)
        assert row["k3_mc_mean"] == pytest.approx(row["kl"], abs=0.01)
        assert row["k1_mc_std"] == pytest.approx(row["k1_std"], rel=0.01)
        assert row["k3_mc_std"] == pytest.approx(row["k3_std"], rel=0.05)


def test_per_tensor_scale_is_one_amax_for_all_rows_and_is_undone_on_exit():
    x = jax.random.normal(jax.random.key(1), (6, 32)) * jnp.arange(1, 7)[:, None]
    per_token = formats.quantize_nvfp4(x, axis=1)
    with nvfp4_global_scale.per_tensor_activations():
        per_tensor = formats.quantize_nvfp4(x, axis=1)
        one_row = formats.quantize_nvfp4(x[5:], axis=1)  # holds the amax: same as per-token
        weights = formats.quantize_nvfp4(x.reshape(2, 16, 6), axis=1)  # 3-D: left alone
    amax = float(jnp.abs(x).max())
    np.testing.assert_allclose(per_tensor.row_scales, np.full((6, 1), amax / (6 * 448)), rtol=1e-6)
    np.testing.assert_array_equal(
        formats.dequantize(one_row), formats.dequantize(formats.quantize_nvfp4(x[5:], axis=1))
    )
    np.testing.assert_array_equal(
        formats.dequantize(weights),
        formats.dequantize(formats.quantize_nvfp4(x.reshape(2, 16, 6), axis=1)),
    )
    # Rows with a smaller amax than the tensor's are quantized differently, the largest not.
    token, tensor = formats.dequantize(per_token), formats.dequantize(per_tensor)
    assert not np.array_equal(token[:5], tensor[:5])
    relative = float(jnp.linalg.norm(tensor - x) / jnp.linalg.norm(x))
    assert 0 < relative < 0.25  # a 4-bit quantization of x, not something else
    restored = formats.quantize_nvfp4(x, axis=1)
    np.testing.assert_array_equal(restored.row_scales, per_token.row_scales)
