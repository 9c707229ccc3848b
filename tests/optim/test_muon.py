"""Muon on one device: equal to optax.contrib.muon on a matrix, per-head/expert/layer batching
equal to slicing, and the Muon / AdamW split."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from composer_jax.config import OptimizerConfig
from composer_jax.optim import make_optimizer, matrix_layout, muon, orthogonalize, split_table
from composer_jax.optim.muon import param_labels
from tests.optim import helpers


@pytest.mark.parametrize("scaling,consistent_rms", [("rms", 0.2), ("spectral", None)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", [(48, 80), (80, 48)])
def test_matches_optax_contrib_muon_on_a_matrix(scaling, consistent_rms, nesterov, shape):
    keys = jax.random.split(jax.random.key(0), 4)
    w = jax.random.normal(keys[0], shape)
    ref = optax.contrib.muon(
        0.1, beta=0.9, nesterov=nesterov, weight_decay=0.01, consistent_rms=consistent_rms
    )
    ours = muon(
        0.1, ("embed", "mlp"), beta=0.9, nesterov=nesterov, weight_decay=0.01, scaling=scaling
    )
    ref_state, our_state = ref.init(w), ours.init(w)
    for key in keys[1:]:
        g = jax.random.normal(key, shape)
        ref_update, ref_state = ref.update(g, ref_state, w)
        our_update, our_state = ours.update(g, our_state, w)
        np.testing.assert_allclose(our_update, ref_update, atol=1e-6, rtol=0)
        w = w + our_update


@jax.jit
def _ref_ns(m):
    """optax.contrib's Newton-Schulz of one 2-D slice (zero momentum: the update is NS(g))."""
    tx = optax.contrib.scale_by_muon(beta=0.0, nesterov=False)
    return tx.update(m, tx.init(m))[0]


def rel_err(a, b) -> float:
    """Frobenius-norm relative error ||a - b|| / ||b||."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_per_head_expert_layer_batching_equals_slices(dtype, tol):
    """Batch axes are independent matrices: the batched result equals optax.contrib's NS of each
    2-D slice. Exactly in float64; in fp32 the summation order of a batched matmul differs from a
    single one, and Newton-Schulz amplifies rounding along small singular directions (up to
    3.4445**5 ~ 500x), so fp32 is compared per parameter in norm."""
    with jax.enable_x64(dtype == np.float64):
        tree = jax.tree.map(lambda x: x.astype(dtype), helpers.make_tree())
        axes = helpers.logical_axes()
        labels = param_labels(axes)(tree)
        matrices = {k: v for k, v in tree.items() if labels[k] == "muon"}
        out = jax.jit(lambda t: orthogonalize(t, {k: axes[k] for k in t}))(matrices)
        slices = {  # parameter -> index of each matrix (the two matrix axes left whole)
            "q_b_proj": [(i, slice(None), h) for i in range(3) for h in range(2)],
            "o_proj": [(i, h) for i in range(3) for h in range(8)],
            "experts_up": [(i, e) for i in range(3) for e in range(8)],
            "experts_down": [(i, e) for i in range(3) for e in range(8)],
            "q_a_proj": [(i,) for i in range(3)],
            "router": [(i,) for i in range(3)],
            "kv_a_proj": [()],
            "mlp_down": [()],
            "shared_down": [()],
        }
        assert set(slices) == set(matrices)
        for name, indices in slices.items():
            got = np.stack([out[name][index] for index in indices])
            want = np.stack([_ref_ns(tree[name][index]) for index in indices])
            assert got.dtype == dtype and got.ndim == 3
            assert rel_err(got, want) < tol, name


def test_split_by_logical_axes_and_table(capsys):
    tree, axes = helpers.make_tree(), helpers.logical_axes()
    labels = param_labels(axes)(tree)
    adamw = sorted(k for k, v in labels.items() if v == "adamw")
    assert adamw == ["embed", "lm_head", "norm"]
    assert matrix_layout(("layers", "q_lora", "heads", "head_dim"), (3, 8, 2, 6)).perm == (
        0,
        2,
        1,
        3,
    )
    with pytest.raises(ValueError, match="matrix axes"):
        matrix_layout(("embed", "heads", "head_dim", "mlp"), (2, 2, 2, 2))
    cfg = OptimizerConfig(name="muon")
    tx = make_optimizer(cfg, optax.constant_schedule(1e-3), axes)
    tx.init(tree)
    tx.init(tree)
    table = capsys.readouterr().out
    assert table.count("q_b_proj") == 1  # printed once per optimizer
    assert "6 x [8, 6]" in table.split("q_b_proj")[1].splitlines()[0]  # layers x heads
    assert "24 x [16, 8]" in table.split("experts_up")[1].splitlines()[0]  # layers x experts
    lines = table.splitlines()[2:-1]
    rows = {line.split()[0]: "muon" if " muon " in line else "adamw" for line in lines}
    assert rows["embed"] == rows["lm_head"] == rows["norm"] == "adamw"
    assert rows["router"] == rows["kv_a_proj"] == "muon"
    assert "muon:" in split_table(tree, axes)


def test_make_optimizer_muon_trains_a_least_squares_problem():
    """Muon + AdamW through make_optimizer decreases a loss over matrices and vectors."""
    tree, axes = helpers.make_tree(), helpers.logical_axes()
    targets = helpers.make_tree(seed=1)
    cfg = dataclasses.replace(
        OptimizerConfig(name="muon", weight_decay=0.0), muon_learning_rate=0.3, learning_rate=0.3
    )
    tx = make_optimizer(cfg, optax.constant_schedule(0.3), axes, verbose=False)

    def loss(p):
        return sum(jnp.mean((p[k] - targets[k]) ** 2) for k in p)

    @jax.jit
    def step(p, s):
        g = jax.grad(loss)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    params = jax.tree.map(jnp.asarray, tree)
    state = tx.init(params)
    start = float(loss(params))
    for _ in range(20):
        params, state = step(params, state)
    assert float(loss(params)) < 0.5 * start


def test_make_optimizer_muon_gives_each_setting_to_its_part():
    """Every optimizer setting through make_optimizer, each set apart from the others (two
    learning rates, momenta, decay), against optax's own parts on fresh gradients: global-norm
    clipping of the whole tree, optax.contrib.muon on the matrix, AdamW on the rest (decaying
    only the 2-D one). A swapped rate or momentum, or AdamW given Muon's rate, shows."""
    cfg = dataclasses.replace(
        OptimizerConfig(name="muon"),
        learning_rate=0.01,
        muon_learning_rate=0.2,
        weight_decay=0.1,
        b1=0.8,
        b2=0.9,
        eps=1e-6,
        muon_momentum=0.7,
        muon_nesterov=False,
        clip_norm=0.5,
    )
    axes = {"w": ("embed", "mlp"), "embed": ("vocab", "embed"), "norm": ("embed",)}
    rng = np.random.default_rng()
    params = {
        "w": jnp.asarray(rng.standard_normal((24, 40)), jnp.float32),
        "embed": jnp.asarray(rng.standard_normal((30, 24)), jnp.float32),
        "norm": jnp.asarray(rng.standard_normal(24), jnp.float32),
    }
    tx = make_optimizer(cfg, optax.constant_schedule(cfg.learning_rate), axes, verbose=False)
    muon_ref = optax.contrib.muon(
        cfg.muon_learning_rate,
        beta=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        weight_decay=cfg.weight_decay,
        consistent_rms=0.2,
    )
    adam_ref = optax.adamw(
        cfg.learning_rate,
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask={"embed": True, "norm": False},
    )
    rest = lambda tree: {k: tree[k] for k in ("embed", "norm")}  # noqa: E731
    state, muon_state, adam_state = (
        tx.init(params),
        muon_ref.init(params["w"]),
        adam_ref.init(rest(params)),
    )
    for _ in range(3):
        grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
        norm = np.sqrt(sum(float(jnp.sum(g**2)) for g in grads.values()))
        clipped = jax.tree.map(lambda g: g * min(1.0, cfg.clip_norm / norm), grads)
        assert norm > cfg.clip_norm  # the clip acts
        updates, state = tx.update(grads, state, params)
        want_w, muon_state = muon_ref.update(clipped["w"], muon_state, params["w"])
        want_rest, adam_state = adam_ref.update(rest(clipped), adam_state, rest(params))
        for name, want in {"w": want_w, **want_rest}.items():
            np.testing.assert_allclose(updates[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
        params = optax.apply_updates(params, updates)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_weight_decay_reaches_every_matrix_and_no_norm_stacked_or_not(name):
    """The tiny model's own parameters under a zero gradient: each moves by its weight decay
    alone (every matrix, layer-stacked, per expert or per head) or not at all (every norm's
    scale, `[layers, dim]` in the stacks as `[dim]` outside them). The amounts per optimizer
    part: `test_make_optimizer_muon_gives_each_setting_to_its_part`."""
    from flax import nnx

    from composer_jax import presets
    from composer_jax.model import Transformer
    from composer_jax.model.layers import logical_axes_of
    from composer_jax.train.step import split_model

    cfg = dataclasses.replace(OptimizerConfig(name=name), weight_decay=0.1, clip_norm=1e9)
    model = presets.tiny().model
    _, params, _ = split_model(nnx.eval_shape(lambda: Transformer(model, nnx.Rngs(0))))
    axes = logical_axes_of(params)
    params = jax.tree.map(lambda p: jnp.ones(p.shape, jnp.float32), params)
    tx = make_optimizer(cfg, optax.constant_schedule(0.01), axes, verbose=False)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    moved = {}
    for path, update in jax.tree_util.tree_leaves_with_path(updates):
        name_ = ".".join(str(getattr(k, "key", k)) for k in path)
        moved[name_] = float(jnp.max(jnp.abs(update)))
    norms = {n: v for n, v in moved.items() if "norm" in n}
    matrices = {n: v for n, v in moved.items() if "norm" not in n}
    assert len(norms) >= 10 and any("layers" in n for n in norms)
    assert all(v == 0.0 for v in norms.values()), norms
    assert all(v > 1e-4 for v in matrices.values()), matrices
