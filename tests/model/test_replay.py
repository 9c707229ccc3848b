"""Router replay's plausibility filter against a per-token numpy reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import presets
from composer_jax.model import init_model
from composer_jax.model import moe as moe_lib


def _reference(scores, forced, own, ratio):
    out, replaced = forced.copy(), np.zeros(forced.shape, bool)
    for n in range(scores.shape[0]):
        threshold = ratio * scores[n, own[n]].min()
        kept = scores[n, forced[n]] >= threshold
        spare = [e for e in own[n] if e not in set(forced[n][kept])]
        for slot in np.flatnonzero(~kept):
            out[n, slot] = spare.pop(0)
        replaced[n] = ~kept
    return out, replaced


@pytest.mark.parametrize("ratio", [0.3, 0.8, 1.0])
def test_filter_matches_reference(ratio):
    rng = np.random.default_rng(int(ratio * 10))
    N, E, k = 64, 16, 4
    scores = rng.uniform(size=(N, E)).astype(np.float32)
    own = np.argsort(-scores, axis=-1)[:, :k].astype(np.int32)
    forced = np.stack([rng.choice(E, k, replace=False) for _ in range(N)]).astype(np.int32)
    forced[:8] = own[:8]  # identical choices are never replaced
    got, replaced = moe_lib.filter_replayed_experts(
        jnp.asarray(scores), jnp.asarray(forced), jnp.asarray(own), ratio
    )
    want, want_replaced = _reference(scores, forced, own, ratio)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(replaced), want_replaced)
    assert not np.asarray(replaced)[:8].any()
    assert 0 < np.asarray(replaced).mean() < 1
    assert all(len(set(row)) == k for row in np.asarray(got))


def test_replay_through_model_counts_replacements_and_trains_router():
    cfg = dataclasses.replace(
        presets.tiny().model, dtype="float32", num_layers=3, num_mtp_layers=0, replay_min_ratio=0.9
    )
    m = init_model(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)
    sampler = m(tokens)
    same = m(tokens, forced_indices_LBTK=sampler.router_indices_LBTK)
    assert float(same.replay_replaced_L.sum()) == 0
    np.testing.assert_array_equal(same.router_indices_LBTK, sampler.router_indices_LBTK)

    router = m.moe_layers.mlp.router
    router[...] = router[...] + 0.5 * jax.random.normal(jax.random.key(1), router[...].shape)
    moved = m(tokens, forced_indices_LBTK=sampler.router_indices_LBTK)
    replaced = np.asarray(moved.replay_replaced_L)
    assert replaced.sum() > 0
    assert replaced.sum() < sampler.router_indices_LBTK.size

    graphdef, params, rest = nnx.split(m, nnx.Param, ...)

    def loss(params):
        model = nnx.merge(graphdef, params, rest)
        out = model(tokens, forced_indices_LBTK=sampler.router_indices_LBTK)
        return jnp.sum(model.logits(out.hidden_BTD) ** 2)

    grad = jax.grad(loss)(params)["moe_layers"]["mlp"]["router"][...]
    assert np.all(np.abs(np.asarray(grad)).max(axis=(1, 2)) > 0)  # every MoE layer's router
