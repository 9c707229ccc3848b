"""Routing statistics: the load per expert counts the recorded choices, and the recorded choices
are the ones the forward pass used (replaying them gives the same logits)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import model, presets
from composer_jax.eval import routing


@pytest.fixture(scope="module")
def tiny():
    return model.init_model(presets.tiny().model, seed=3)  # one dense, one MoE layer


def test_load_counts_choices_and_choices_are_the_ones_used(tiny):
    tokens = jax.random.randint(jax.random.key(0), (40,), 3, tiny.cfg.vocab_size)
    stats = routing.routing_stats(tiny, tokens)
    layers, k = tiny.cfg.num_moe_layers, tiny.cfg.num_experts_per_tok
    assert stats.experts_LTK.shape == (layers, 40, k) and stats.first_moe_layer == 1
    for layer in range(layers):
        counts = np.bincount(stats.experts_LTK[layer].ravel(), minlength=tiny.cfg.num_experts)
        np.testing.assert_array_equal(stats.load_LE[layer], counts)
    np.testing.assert_allclose(stats.load_share_LE.sum(axis=1), 1.0)
    np.testing.assert_allclose(
        stats.imbalance_L, stats.load_LE.max(1) / stats.load_LE.mean(1), rtol=1e-6
    )
    graphdef, state = nnx.split(tiny)

    @jax.jit
    def logits(forced):
        m = nnx.merge(graphdef, state)
        batch = tokens[None]
        positions = jnp.arange(40)[None]
        out = m(batch, positions, jnp.ones_like(batch), forced, with_mtp=False)
        return m.logits(out.hidden_BTD)

    free = logits(None)
    replayed = logits(jnp.asarray(stats.experts_LTK)[:, None])
    np.testing.assert_array_equal(np.asarray(free), np.asarray(replayed))
    other = (stats.experts_LTK + 1) % tiny.cfg.num_experts  # different experts: different logits
    assert not np.allclose(np.asarray(free), np.asarray(logits(jnp.asarray(other)[:, None])))
    assert "max/mean" in stats.table()


def test_bad_input_is_named(tiny):
    with pytest.raises(ValueError, match="1-D"):
        routing.routing_stats(tiny, np.zeros((2, 3), np.int32))
