"""Sharded Muon on 8 simulated devices: the update equals the single-device one on every layout."""

import dataclasses
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.config import MeshConfig, OptimizerConfig
from composer_jax.optim import make_optimizer, orthogonalize, shard_like_params
from composer_jax.parallel import make_layout
from tests.optim import helpers
from tests.optim.test_muon import rel_err

CFG = dataclasses.replace(OptimizerConfig(name="muon"), weight_decay=0.1, muon_learning_rate=0.02)
LAYOUTS = [(1, 8, 1), (2, 4, 1), (1, 4, 2), (2, 2, 2)]


def _update(shardings):
    """One jitted Muon + AdamW update (sharded when `shardings` is given) from a state with random
    moments and counts at 3, as after a few steps: (updates, new state)."""
    axes = helpers.logical_axes()
    tx = make_optimizer(CFG, optax.constant_schedule(1e-2), axes, shardings, verbose=False)
    params = helpers.put(helpers.make_tree(0), shardings)
    rng = np.random.default_rng(3)
    state = jax.tree.map(
        lambda x: (
            x + 3
            if x.ndim == 0
            else jax.device_put(np.abs(rng.standard_normal(x.shape)).astype(np.float32), x.sharding)
        ),
        tx.init(params),
    )
    return jax.jit(tx.update)(helpers.put(helpers.make_tree(1), shardings), state, params)


@pytest.fixture(scope="module")
def single_device():
    return _update(None)


@pytest.mark.parametrize("shape", LAYOUTS)
def test_sharded_update_equals_single_device(shape, single_device):
    layout = make_layout(MeshConfig(*shape))
    shardings = layout.tree_shardings(helpers.logical_axes(), helpers.make_tree())
    got, _ = _update(shardings)
    ref, _ = single_device
    for name in ref:
        assert rel_err(got[name], ref[name]) < 1e-5, (shape, name)
        assert got[name].sharding.is_equivalent_to(shardings[name], got[name].ndim)


def test_all_gather_baseline_and_two_sharded_matrix_dims():
    """The all-gather relayout gives the same matrices, and a hand-made layout that shards both
    matrix dimensions (rows over fsdp, columns over cp) works too."""
    mesh = make_layout(MeshConfig(2, 2, 2)).mesh
    axes = {"w": ("layers", "embed", "mlp")}
    tree = {"w": np.asarray(helpers.make_tree()["experts_up"][0, :4])}  # [4, 16, 8]
    ref = jax.jit(lambda t: orthogonalize(t, axes))(tree)
    for spec in (P(None, "fsdp", "cp"), P("replica", "cp", "fsdp"), P(None, ("cp", "fsdp"))):
        sh = {"w": NamedSharding(mesh, spec)}
        x = jax.device_put(tree, sh)
        for relayout in ("all_to_all", "all_gather"):
            out = jax.jit(lambda t, r=relayout, s=sh: orthogonalize(t, axes, s, relayout=r))(x)
            assert rel_err(out["w"], ref["w"]) < 1e-5, (spec, relayout)


def test_matrices_sharded_alike_share_one_all_to_all_each_way():
    """Three shapes of matrix sharded alike (rows over fsdp x cp) take one all-to-all into the
    whole-matrix layout and one back, not two per shape, and still equal one device."""
    mesh = make_layout(MeshConfig(1, 4, 2)).mesh
    rng = np.random.default_rng(5)
    shapes = {"a": (3, 16, 8), "b": (5, 8, 6), "c": (2, 24, 4)}
    tree = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    axes = {k: ("layers", "embed", "mlp") for k in tree}
    sh = {k: NamedSharding(mesh, P(None, ("fsdp", "cp"), None)) for k in tree}
    sharded = jax.jit(lambda t: orthogonalize(t, axes, sh))
    x = jax.device_put(tree, sh)
    hlo = sharded.lower(x).compile().as_text()
    assert len(re.findall(r" all-to-all\(", hlo)) == 2, hlo
    ref = jax.jit(lambda t: orthogonalize(t, axes))(tree)
    out = sharded(x)
    for k in tree:
        assert rel_err(out[k], ref[k]) < 1e-5, k


def test_optimizer_state_shardings_follow_the_parameters():
    """shard_like_params gives the Muon momentum and Adam moments their parameters' shardings."""
    layout = make_layout(MeshConfig(1, 8, 1))
    tree = helpers.make_tree()
    shardings = layout.tree_shardings(helpers.logical_axes(), tree)
    tx = make_optimizer(
        CFG, optax.constant_schedule(1e-2), helpers.logical_axes(), shardings, verbose=False
    )
    state = jax.eval_shape(tx.init, tree)
    replicated = NamedSharding(layout.mesh, P())
    state_sh = shard_like_params(state, tree, shardings, replicated)
    flat = jax.tree_util.tree_flatten_with_path(state_sh)[0]
    by_name = {}
    for path, sh in flat:
        keys = [getattr(k, "key", None) for k in path]
        name = next((k for k in keys if k in tree), None)
        by_name.setdefault(name, []).append(sh)
    assert all(sh == shardings["q_b_proj"] for sh in by_name["q_b_proj"])  # Muon momentum
    assert len(by_name["embed"]) == 2  # Adam mu and nu
    assert all(sh == shardings["embed"] for sh in by_name["embed"])
    assert all(sh == replicated for sh in by_name[None])  # counters
    assert shardings["q_b_proj"].spec != P()


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_shard_like_params_on_the_model_train_state(name):
    """On the real (abstract) nnx train state, every parameter-shaped optimizer leaf gets its
    parameter's sharding: Adam moments as before, and Muon's masked momentum too."""
    from flax import nnx

    from composer_jax import presets
    from composer_jax.model.layers import logical_axes_of
    from composer_jax.model.transformer import Transformer
    from composer_jax.train.step import init_train_state, split_model

    model_cfg = presets.tiny().model
    layout = make_layout(MeshConfig(1, 8, 1))
    model = nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0)))
    _, params, _ = split_model(model)
    axes = logical_axes_of(params)
    param_sh = layout.tree_shardings(axes, params)
    cfg = dataclasses.replace(OptimizerConfig(), name=name)
    tx = make_optimizer(cfg, optax.constant_schedule(1e-3), axes, param_sh, verbose=False)
    state = jax.eval_shape(lambda: init_train_state(Transformer(model_cfg, nnx.Rngs(0)), tx))
    replicated = NamedSharding(layout.mesh, P())
    opt_sh = shard_like_params(state.opt_state, state.params, param_sh, replicated)
    by_shape = {}
    for x, sh in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(opt_sh)):
        by_shape.setdefault(x.shape, set()).add(sh.spec)
    param_specs = {}
    for x, sh in zip(jax.tree.leaves(params), jax.tree.leaves(param_sh)):
        param_specs.setdefault(x.shape, set()).add(sh.spec)
    moments = [s for s in by_shape if s != ()]
    assert len(moments) > 20
    for shape in moments:
        assert by_shape[shape] <= param_specs[shape], shape
    assert by_shape[()] == {P()}
