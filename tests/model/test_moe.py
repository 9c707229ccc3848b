"""MoE routing, expert computation, router replay and load balancing against float64 references."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax.model import moe as moe_lib
from tests.helpers import tiny_model_config
from tests.model import reference as ref

B, T = 2, 6


def _cfg(**kw):
    base = dict(
        replay_min_ratio=0.0,  # plain replay: forced experts are kept (test_replay checks the filter)
        hidden_size=32,
        moe_intermediate_size=16,
        num_experts=8,
        num_experts_per_tok=2,
        num_shared_experts=1,
        routed_scaling_factor=2.5,
    )
    return tiny_model_config(**{**base, **kw})


ROUTE_CFGS = {
    "flat": _cfg(
        num_experts=12, num_experts_per_tok=3, n_group=1, topk_group=1, routed_scaling_factor=2.5
    ),
    "grouped": _cfg(
        num_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=1.7
    ),
}
# Bias range per case: "grouped_negative" pushes many biased scores below zero, the regime where
# masking dropped groups with -inf (DeepSeek-V3, transformers 5) and with 0.0 (transformers 4)
# give different choices.
BIAS_RANGE = {"flat": (-0.3, 0.3), "grouped": (-0.3, 0.3), "grouped_negative": (-1.2, 0.1)}
ROUTE_CFGS["grouped_negative"] = ROUTE_CFGS["grouped"]

LAYER_CFGS = {
    "flat": _cfg(n_group=1, topk_group=1),
    "grouped": _cfg(n_group=4, topk_group=2),
}


@functools.partial(jax.jit, static_argnums=2)
def _route_jit(scores, bias, cfg, forced=None):
    return moe_lib.route(scores, bias, cfg, forced)[0]


# ----------------------------------------------------------------------------- route


@pytest.mark.parametrize("name", sorted(ROUTE_CFGS))
def test_route_matches_deepseek_v3_reference(name):
    cfg = ROUTE_CFGS[name]
    rng = np.random.default_rng(0)
    E = cfg.num_experts
    scores = ref.sigmoid(rng.normal(size=(3, 40, E)) * 1.5).astype(np.float32)
    bias = rng.uniform(*BIAS_RANGE[name], size=E).astype(np.float32)
    kw = ref.route_kwargs(cfg)

    got = _route_jit(jnp.asarray(scores), jnp.asarray(bias), cfg)
    want_idx, want_w = ref.route(scores.reshape(-1, E), bias, **kw)

    # The bias must really change the selection here, and the group limit too (if any).
    idx_no_bias, _ = ref.route(scores.reshape(-1, E), np.zeros(E), **kw)
    assert (np.sort(idx_no_bias, -1) != np.sort(want_idx, -1)).any()
    if cfg.n_group > 1:
        idx_no_groups, _ = ref.route(scores.reshape(-1, E), bias, **dict(kw, n_group=1))
        assert (np.sort(idx_no_groups, -1) != np.sort(want_idx, -1)).any()
        if name == "grouped_negative":
            idx_zero_mask, _ = ref.route(scores.reshape(-1, E), bias, **dict(kw, mask_value=0.0))
            assert (np.sort(idx_zero_mask, -1) != np.sort(want_idx, -1)).any()
        # Only experts of the topk_group best groups are ever chosen.
        per_group = E // cfg.n_group
        choice = (scores + bias).reshape(-1, cfg.n_group, per_group)
        group_score = np.sort(choice, -1)[..., -2:].sum(-1)
        kept = np.argsort(-group_score, -1)[:, : cfg.topk_group]
        got_groups = np.asarray(got.indices_BTK).reshape(-1, cfg.num_experts_per_tok) // per_group
        assert all(set(g) <= set(kg) for g, kg in zip(got_groups, kept))

    assert got.indices_BTK.dtype == jnp.int32
    assert got.weights_BTK.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(got.indices_BTK).reshape(-1, cfg.num_experts_per_tok), want_idx
    )
    np.testing.assert_allclose(
        np.asarray(got.weights_BTK).reshape(want_w.shape), want_w, rtol=1e-6, atol=1e-7
    )
    # Weights come from the unbiased scores: they sum to the scaling factor.
    np.testing.assert_allclose(
        np.asarray(got.weights_BTK).sum(-1), cfg.routed_scaling_factor, rtol=1e-6
    )
    np.testing.assert_array_equal(np.asarray(got.scores_BTE), scores)


def test_route_forced_indices_use_unbiased_scores():
    cfg = ROUTE_CFGS["grouped"]
    rng = np.random.default_rng(1)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    scores = ref.sigmoid(rng.normal(size=(2, 5, E))).astype(np.float32)
    bias = rng.uniform(-1, 1, size=E).astype(np.float32)
    forced = np.stack([rng.permutation(E)[:k] for _ in range(10)]).reshape(2, 5, k)
    got = _route_jit(jnp.asarray(scores), jnp.asarray(bias), cfg, jnp.asarray(forced))
    np.testing.assert_array_equal(np.asarray(got.indices_BTK), forced)
    w = np.take_along_axis(scores.astype(np.float64), forced, -1)
    w = w / w.sum(-1, keepdims=True) * cfg.routed_scaling_factor
    np.testing.assert_allclose(np.asarray(got.weights_BTK), w, rtol=1e-6)


# ----------------------------------------------------------------------------- MoE layer


def _make_layer(cfg, seed=0):
    layer = moe_lib.MoE(cfg, nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 100)
    layer.expert_bias[...] = jnp.asarray(rng.uniform(-0.5, 0.5, cfg.num_experts), jnp.float32)
    return layer


def _numpy_params(layer) -> dict:
    p = {name: np.asarray(getattr(layer, name)[...]) for name in ("router", "gate", "up", "down")}
    p["bias"] = np.asarray(layer.expert_bias[...])
    if layer.shared is not None:
        for name in ("gate", "up", "down"):
            p["shared_" + name] = np.asarray(getattr(layer.shared, name)[...])
    return p


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, x, valid, forced=None):
    """(output, routing, load): the layer with its statistics reduced to the expert load."""
    out, routing, stats = nnx.merge(graphdef, state)(x, valid, forced)
    return out, routing, stats.load_E


def _inputs(cfg, seed=2):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, cfg.hidden_size)).astype(np.float32)
    segments = np.ones((B, T), np.int32)
    segments[0, -2:] = 0  # padding
    segments[1, :3] = 2
    return x, segments


@pytest.fixture(scope="module", params=sorted(LAYER_CFGS))
def layer_setup(request):
    cfg = LAYER_CFGS[request.param]
    layer = _make_layer(cfg)
    graphdef, state = nnx.split(layer)
    x, segments = _inputs(cfg)
    out, routing, load = _apply(graphdef, state, jnp.asarray(x), jnp.asarray(segments > 0))
    return dict(
        cfg=cfg,
        layer=layer,
        graphdef=graphdef,
        state=state,
        x=x,
        segments=segments,
        out=out,
        routing=routing,
        load=load,
        p=_numpy_params(layer),
    )


def test_moe_layer_matches_dense_reference(layer_setup):
    s = layer_setup
    cfg, x = s["cfg"], s["x"]
    want, want_idx = ref.moe(x.reshape(-1, cfg.hidden_size), s["p"], cfg)
    # The bias changes the selection for these inputs.
    p_nobias = dict(s["p"], bias=np.zeros(cfg.num_experts))
    _, idx_nobias = ref.moe(x.reshape(-1, cfg.hidden_size), p_nobias, cfg)
    assert (np.sort(idx_nobias, -1) != np.sort(want_idx, -1)).any()

    assert s["out"].shape == x.shape and s["out"].dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(s["routing"].indices_BTK).reshape(want_idx.shape), want_idx
    )
    np.testing.assert_allclose(np.asarray(s["out"]).reshape(want.shape), want, rtol=1e-4, atol=1e-5)


def test_expert_load_is_bincount_over_valid_tokens(layer_setup):
    s = layer_setup
    cfg = s["cfg"]
    idx = np.asarray(s["routing"].indices_BTK)
    valid = s["segments"] > 0
    want = np.bincount(idx[valid].reshape(-1), minlength=cfg.num_experts)
    assert s["load"].shape == (cfg.num_experts,)
    np.testing.assert_array_equal(np.asarray(s["load"]), want.astype(np.float32))
    assert np.asarray(s["load"]).sum() == valid.sum() * cfg.num_experts_per_tok
    # Padding tokens are routed but not counted.
    assert np.bincount(idx.reshape(-1), minlength=cfg.num_experts).sum() > want.sum()


def test_replay_of_own_indices_is_exact(layer_setup):
    s = layer_setup
    out, routing, load = _apply(
        s["graphdef"],
        s["state"],
        jnp.asarray(s["x"]),
        jnp.asarray(s["segments"] > 0),
        s["routing"].indices_BTK,
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(s["out"]))
    np.testing.assert_array_equal(
        np.asarray(routing.indices_BTK), np.asarray(s["routing"].indices_BTK)
    )
    np.testing.assert_array_equal(
        np.asarray(routing.weights_BTK), np.asarray(s["routing"].weights_BTK)
    )
    np.testing.assert_array_equal(np.asarray(load), np.asarray(s["load"]))


def _other_indices(cfg, own, seed=3):
    rng = np.random.default_rng(seed)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    forced = np.stack([rng.permutation(E)[:k] for _ in range(B * T)]).reshape(B, T, k)
    forced = forced.astype(np.int32)
    assert (np.sort(forced, -1) != np.sort(own, -1)).any(-1).sum() >= B * T // 2
    return forced


def test_replay_of_other_indices(layer_setup):
    s = layer_setup
    cfg = s["cfg"]
    forced = _other_indices(cfg, np.asarray(s["routing"].indices_BTK))
    out, routing, load = _apply(
        s["graphdef"],
        s["state"],
        jnp.asarray(s["x"]),
        jnp.asarray(s["segments"] > 0),
        jnp.asarray(forced),
    )
    np.testing.assert_array_equal(np.asarray(routing.indices_BTK), forced)
    changed = (np.sort(forced, -1) != np.sort(np.asarray(s["routing"].indices_BTK), -1)).any(-1)
    diff = np.abs(np.asarray(out) - np.asarray(s["out"])).max(-1)
    assert (diff[changed] > 1e-4).all()
    assert (diff[~changed] < 1e-5).all()  # same experts (maybe reordered): same output
    want, _ = ref.moe(
        s["x"].reshape(-1, cfg.hidden_size),
        s["p"],
        cfg,
        forced.reshape(-1, cfg.num_experts_per_tok),
    )
    np.testing.assert_allclose(np.asarray(out).reshape(want.shape), want, rtol=1e-4, atol=1e-5)
    valid = s["segments"] > 0
    np.testing.assert_array_equal(
        np.asarray(load), np.bincount(forced[valid].reshape(-1), minlength=cfg.num_experts)
    )


def _router_grad_reference(x_ND, p, cfg, forced_NK, cot_ND):
    """d/d router of sum(cot * moe(x)) with the experts fixed to `forced`, float64."""
    x = ref.f64(x_ND)
    scores = ref.sigmoid(x @ ref.f64(p["router"]))
    s_sel = np.take_along_axis(scores, forced_NK, -1)
    total = s_sel.sum(-1, keepdims=True) + 1e-20
    expert_out = np.stack(
        [
            np.stack(
                [ref.swiglu(x[n], p["gate"][e], p["up"][e], p["down"][e]) for e in forced_NK[n]]
            )
            for n in range(x.shape[0])
        ]
    )  # [N, k, D]
    g_w = np.einsum("nkd,nd->nk", expert_out, ref.f64(cot_ND)) * cfg.routed_scaling_factor
    g_sel = g_w / total - (g_w * s_sel).sum(-1, keepdims=True) / total**2
    g_scores = np.zeros_like(scores)
    np.put_along_axis(g_scores, forced_NK, g_sel, -1)
    g_logits = g_scores * scores * (1 - scores)
    return x.T @ g_logits


def test_replay_gradients_reach_router(layer_setup):
    s = layer_setup
    cfg = s["cfg"]
    forced = _other_indices(cfg, np.asarray(s["routing"].indices_BTK), seed=4)
    cot = np.random.default_rng(5).normal(size=s["x"].shape).astype(np.float32)
    graphdef, params, rest = nnx.split(s["layer"], nnx.Param, ...)

    @jax.jit
    def grads(params, forced):
        def loss(params):
            out, _, _ = nnx.merge(graphdef, params, rest)(
                jnp.asarray(s["x"]), jnp.asarray(s["segments"] > 0), forced
            )
            return jnp.sum(out * cot)

        return jax.grad(loss)(params)

    g = grads(params, jnp.asarray(forced))
    g_router = np.asarray(g["router"][...])
    want = _router_grad_reference(
        s["x"].reshape(-1, cfg.hidden_size),
        s["p"],
        cfg,
        forced.reshape(-1, cfg.num_experts_per_tok),
        cot.reshape(-1, cfg.hidden_size),
    )
    assert np.abs(want).max() > 1e-3
    np.testing.assert_allclose(g_router, want, rtol=1e-3, atol=1e-5 * np.abs(want).max())
    # Replaying the router's own choice gives the same gradient as not replaying.
    g_own = grads(params, s["routing"].indices_BTK)

    @jax.jit
    def grads_free(params):
        def loss(params):
            out, _, _ = nnx.merge(graphdef, params, rest)(
                jnp.asarray(s["x"]), jnp.asarray(s["segments"] > 0)
            )
            return jnp.sum(out * cot)

        return jax.grad(loss)(params)

    np.testing.assert_allclose(
        np.asarray(g_own["router"][...]),
        np.asarray(grads_free(params)["router"][...]),
        rtol=1e-6,
        atol=1e-9,
    )


# ----------------------------------------------------------------------------- balancing


def test_update_expert_bias_direction():
    rng = np.random.default_rng(6)
    E, rate = 8, 1e-3
    bias = rng.normal(size=E).astype(np.float32)
    load = np.array([5, 0, 12, 4, 4, 9, 3, 3], np.float32)  # mean 5: one expert exactly at it
    new = np.asarray(moe_lib.update_expert_bias(jnp.asarray(bias), jnp.asarray(load), rate))
    step = new.astype(np.float64) - bias
    mean = load.mean()
    np.testing.assert_allclose(step[load < mean], rate, rtol=1e-3)
    np.testing.assert_allclose(step[load > mean], -rate, rtol=1e-3)
    np.testing.assert_allclose(step[load == mean], 0.0, atol=1e-7)

    # Per-layer loads [L, E]: each layer is balanced against its own mean.
    loads = rng.integers(0, 20, size=(3, E)).astype(np.float32)
    biases = rng.normal(size=(3, E)).astype(np.float32)
    new = np.asarray(moe_lib.update_expert_bias(jnp.asarray(biases), jnp.asarray(loads), rate))
    want = biases + rate * np.sign(loads.mean(-1, keepdims=True) - loads)
    np.testing.assert_allclose(new, want, rtol=1e-6, atol=1e-7)


def test_bias_update_balances_routing():
    """Repeated updates from measured load move an unbalanced router towards balance."""
    cfg = ROUTE_CFGS["flat"]
    rng = np.random.default_rng(7)
    E = cfg.num_experts
    skew = np.linspace(-1.5, 1.5, E)
    scores = jnp.asarray(ref.sigmoid(rng.normal(size=(1, 256, E)) + skew), jnp.float32)
    bias = jnp.zeros((E,), jnp.float32)

    def imbalance(bias):
        idx = np.asarray(_route_jit(scores, bias, cfg).indices_BTK)
        load = np.bincount(idx.reshape(-1), minlength=E)
        return load, load.max() / load.mean()

    _, before = imbalance(bias)
    for _ in range(60):
        load, _ = imbalance(bias)
        bias = moe_lib.update_expert_bias(bias, jnp.asarray(load, jnp.float32), 0.02)
    _, after = imbalance(bias)
    assert before > 2.0
    assert after < 0.6 * before


def _balance_loss_reference(scores, indices, valid):
    """DeepSeek-V3's L_Bal of each row, written out token by token in float64."""
    B, T, E = scores.shape
    k = indices.shape[-1]
    losses = []
    for b in range(B):
        tokens = [t for t in range(T) if valid[b, t]]
        f = np.zeros(E)
        p = np.zeros(E)
        for t in tokens:
            for i in set(indices[b, t].tolist()):
                f[i] += E / (k * max(len(tokens), 1))
            p += scores[b, t] / scores[b, t].sum() / max(len(tokens), 1)
        losses.append(float(f @ p))
    return np.asarray(losses)


def test_sequence_balance_loss_matches_the_written_out_definition():
    """Per row over its valid tokens only (a padded row, an empty row); 1 when every row's tokens
    choose each expert equally often and score them alike; the gradient reaches the scores
    only through P (f is a count)."""
    rng = np.random.default_rng(0)
    B, T, E, k = 4, 10, 6, 2
    scores = rng.uniform(0.05, 1.0, (B, T, E))
    indices = np.stack([rng.permutation(E)[:k] for _ in range(B * T)]).reshape(B, T, k)
    valid = np.ones((B, T), bool)
    valid[1, 6:] = False
    valid[3] = False
    got = moe_lib.sequence_balance_loss(
        jnp.asarray(scores), jnp.asarray(indices), jnp.asarray(valid)
    )
    np.testing.assert_allclose(got, _balance_loss_reference(scores, indices, valid), rtol=1e-5)
    assert got[3] == 0
    even = np.arange(E).reshape(1, E // k, k).repeat(2, 0)  # each expert once per row
    uniform = moe_lib.sequence_balance_loss(
        jnp.ones((2, E // k, E)), jnp.asarray(even), jnp.ones((2, E // k), bool)
    )
    np.testing.assert_allclose(uniform, 1.0, rtol=1e-6)
    grad = jax.grad(
        lambda s: moe_lib.sequence_balance_loss(s, jnp.asarray(indices), jnp.asarray(valid)).sum()
    )(jnp.asarray(scores, jnp.float32))
    assert np.abs(np.asarray(grad)[valid]).max() > 0 and (np.asarray(grad)[~valid] == 0).all()
