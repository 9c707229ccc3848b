"""The tiled grouped matmul (XLA:CPU's expert GEMM) against a float64 loop and `lax.ragged_dot`:
values and gradients, ragged / empty / single-row groups, rows past the groups, one compiled
program for every group-size vector, the platform choice, and the whole model's loss and
gradients on one device and on the simulated 8-device mesh."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import config as config_lib
from composer_jax import presets
from composer_jax.model import grouped_gemm, init_model
from composer_jax.model import moe as moe_lib
from composer_jax.model.layers import logical_axes_of
from composer_jax.parallel import make_layout, use_layout
from composer_jax.train import step as S
from tests.train.helpers import small_model_config
from tests.train.test_step import _packed_batch

M, K, N = 37, 12, 10
GROUP_SIZES = {
    "ragged": [3, 11, 0, 17, 6],
    "empty_and_single_rows": [0, 1, 0, 35, 1],
    "all_in_one_group": [0, 0, 37, 0, 0],
    "rows_past_the_groups": [4, 0, 9, 1, 2],
    "no_rows_in_groups": [0, 0, 0, 0, 0],
    "single_group_last": [0, 0, 0, 0, 37],
}


def _reference(lhs, rhs, sizes, grad_out):
    """float64 loop: (out, d lhs, d rhs) of rows [start_g, start_g + n_g) times rhs[g]."""
    lhs, rhs, grad_out = (np.asarray(a, np.float64) for a in (lhs, rhs, grad_out))
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    grad_lhs, grad_rhs = np.zeros_like(lhs), np.zeros_like(rhs)
    start = 0
    for g, n in enumerate(sizes):
        rows = slice(start, start + n)
        out[rows] = lhs[rows] @ rhs[g]
        grad_lhs[rows] = grad_out[rows] @ rhs[g].T
        grad_rhs[g] = lhs[rows].T @ grad_out[rows]
        start += n
    return out, grad_lhs, grad_rhs


def _inputs(seed, dtype, num_groups=5):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.normal(size=(M, K)), dtype)
    rhs = jnp.asarray(rng.normal(size=(num_groups, K, N)), dtype)
    grad_out = jnp.asarray(rng.normal(size=(M, N)), dtype)
    return lhs, rhs, grad_out


def _value_and_grads(fn, lhs, rhs, sizes, grad_out):
    out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
    return (out, *vjp(grad_out))


def _max_rel(got, want):
    got = np.asarray(got, np.float64)
    return np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)


@pytest.mark.parametrize("tile_rows", [None, 1, 4, 8, 64])
def test_matches_float64_loop(tile_rows):
    """Every group-size case through one compiled program per tile height."""
    fn = jax.jit(lambda a, b, g: grouped_gemm.grouped_matmul(a, b, g, tile_rows))
    for seed, (case, sizes) in enumerate(sorted(GROUP_SIZES.items())):
        lhs, rhs, grad_out = _inputs(seed + 10 * (tile_rows or 0), jnp.float32)
        got = _value_and_grads(fn, lhs, rhs, jnp.asarray(sizes, jnp.int32), grad_out)
        want = _reference(lhs, rhs, sizes, grad_out)
        for g, w in zip(got, want):
            assert g.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5, err_msg=case)
        past = sum(sizes)
        assert not np.asarray(got[0][past:]).any() and not np.asarray(got[1][past:]).any()


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-6), ("bfloat16", 1e-2)])
def test_matches_ragged_dot_on_random_group_sizes(dtype, tol):
    """Fresh multinomial group sizes (some empty, sum short of the rows), both compute dtypes."""
    rng = np.random.default_rng(7)
    fn = jax.jit(grouped_gemm.grouped_matmul)
    ragged = jax.jit(moe_lib._ragged_dot)
    for trial in range(4):
        num_groups = int(rng.integers(2, 9))
        lhs, rhs, grad_out = _inputs(100 + trial, dtype, num_groups)
        weights = rng.dirichlet(np.full(num_groups, 0.5))
        sizes = rng.multinomial(int(rng.integers(M - 8, M + 1)), weights).astype(np.int32)
        got = _value_and_grads(fn, lhs, rhs, jnp.asarray(sizes), grad_out)
        base = _value_and_grads(ragged, lhs, rhs, jnp.asarray(sizes), grad_out)
        want = _reference(lhs, rhs, sizes, grad_out)
        for g, b, w in zip(got, base, want):
            assert g.dtype == b.dtype == jnp.dtype(dtype)
            assert _max_rel(g, w) < tol, (trial, sizes)
            assert _max_rel(g, np.asarray(b, np.float64)) < 2 * tol, (trial, sizes)


def test_one_program_for_every_group_size_vector():
    lhs, rhs, grad_out = _inputs(3, jnp.float32)
    traces = []

    @jax.jit
    def fn(a, b, g):
        traces.append(g)
        return _value_and_grads(grouped_gemm.grouped_matmul, a, b, g, grad_out)

    for case, sizes in GROUP_SIZES.items():
        got = fn(lhs, rhs, jnp.asarray(sizes, jnp.int32))
        np.testing.assert_allclose(
            np.asarray(got[0]), _reference(lhs, rhs, sizes, grad_out)[0], rtol=1e-5, atol=1e-5
        )
    assert len(traces) == 1


def test_tile_plan_places_every_row_once():
    rng = np.random.default_rng(11)
    rows, num_groups = 40, 6
    plan_fn = jax.jit(grouped_gemm.plan_tiles, static_argnums=(1, 2))
    for tile_rows in (1, 3, 8, 16):
        tiles = grouped_gemm.tile_count(rows, num_groups, tile_rows)
        for _ in range(6):
            weights = rng.dirichlet(np.full(num_groups, 0.4))
            sizes = rng.multinomial(int(rng.integers(0, rows + 1)), weights)
            plan = plan_fn(jnp.asarray(sizes, jnp.int32), rows, tile_rows)
            source, slot = np.asarray(plan.source_row), np.asarray(plan.slot_of_row)
            assert source.shape == (tiles * tile_rows,)
            placed = np.arange(sizes.sum())
            np.testing.assert_array_equal(np.sort(source[source < rows]), placed)
            np.testing.assert_array_equal(source[slot[placed]], placed)
            assert (slot[sizes.sum() :] == tiles * tile_rows).all()
            tile_group = np.asarray(plan.group_of_tile)[slot[placed] // tile_rows]
            np.testing.assert_array_equal(tile_group, np.repeat(np.arange(num_groups), sizes))


@pytest.mark.parametrize(
    "rows, groups, want",
    [
        (2048, 8, 64),
        (15360, 8, 128),
        (40960, 8, 344),
        (81920, 6, 912),
        (5, 8, 8),
        (10**6, 1, 66672),
    ],
)
def test_default_tiles_are_fast_but_never_hold_many_copies_of_the_weights(rows, groups, want):
    """A quarter of the mean group up to 128 rows (the benchmark's fastest), larger where that
    would gather more than MAX_WEIGHT_COPIES x the weights (the 1T shape's 81,920 rows over 6
    experts)."""
    tile_rows = grouped_gemm.default_tile_rows(rows, groups)
    assert tile_rows == want and tile_rows % 8 == 0
    tiles = grouped_gemm.tile_count(rows, groups, tile_rows)
    assert tiles <= grouped_gemm.MAX_WEIGHT_COPIES * groups


def test_rejects_bad_shapes():
    lhs, rhs, _ = _inputs(0, jnp.float32)
    with pytest.raises(ValueError, match="rhs"):
        grouped_gemm.grouped_matmul(lhs, rhs[:, :-1], jnp.zeros(5, jnp.int32))
    with pytest.raises(ValueError, match="group_sizes must have shape"):
        grouped_gemm.grouped_matmul(lhs, rhs, jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="integers"):
        grouped_gemm.grouped_matmul(lhs, rhs, jnp.zeros(5, jnp.float32))
    with pytest.raises(ValueError, match="impl"):
        moe_lib.expert_gemm(lhs, rhs, jnp.zeros(5, jnp.int32), impl="dense")


def test_platform_choice():
    """The "auto" impl lowers to the tiled product for CPU (no [groups, rows, K] dense
    expansion) and to ragged_dot for CUDA; a forced impl is used whatever the platform."""
    lhs, rhs, _ = _inputs(1, jnp.bfloat16)
    sizes = jnp.asarray(GROUP_SIZES["ragged"], jnp.int32)
    dense_expansion = f"tensor<5x{M}x{K}x"

    def lowered(impl, platform):
        fn = jax.grad(lambda a, b: moe_lib.expert_gemm(a, b, sizes, impl=impl).sum(), (0, 1))
        return jax.jit(fn).trace(lhs, rhs).lower(lowering_platforms=(platform,)).as_text()

    auto_cpu = lowered("auto", "cpu")
    assert "ragged_dot" not in auto_cpu and dense_expansion not in auto_cpu
    assert "gather" in auto_cpu
    assert "ragged_dot" in lowered("auto", "cuda")
    assert dense_expansion in lowered("ragged_dot", "cpu")
    assert "ragged_dot" not in lowered("tiled", "cuda")


def test_config_switch_is_validated():
    base = presets.tiny()
    for bad, match in (
        (dict(expert_gemm_impl="dense"), "must be one of"),
        (dict(expert_gemm_impl="tiled", expert_precision="mxfp8"), "applies to"),
    ):
        cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, **bad))
        with pytest.raises(config_lib.ConfigError, match=f"model.expert_gemm_impl: .*{match}"):
            config_lib.validate(cfg)
    ok = dataclasses.replace(base.model, expert_gemm_impl="ragged_dot")
    config_lib.validate(dataclasses.replace(base, model=ok))


# ----------------------------------------------------------------------------- whole model
def _loss_and_grads(impl, layout, batch):
    cfg = small_model_config(
        num_layers=2, num_mtp_layers=0, n_group=2, topk_group=2, dtype="float32"
    )
    m = init_model(dataclasses.replace(cfg, expert_gemm_impl=impl), seed=5)
    graphdef, params, buffers = S.split_model(m)

    def loss(params, buffers, batch):
        with use_layout(layout):
            return S.pretrain_loss(
                nnx.merge(graphdef, params, buffers), batch, config_lib.TrainConfig()
            )[0]

    args = (params, buffers, batch)
    if layout is not None:
        shardings = (
            layout.tree_shardings(logical_axes_of(params), params),
            layout.tree_shardings(logical_axes_of(buffers), buffers),
            {k: layout.batch_sharding() for k in batch},
        )
        args = jax.device_put(args, shardings)
    value, grads = jax.jit(jax.value_and_grad(loss))(*args)
    return float(value), jax.tree.map(lambda a: np.asarray(a, np.float64), grads)


@pytest.fixture(scope="module")
def model_batch():
    return _packed_batch(np.random.default_rng(4), B=8, T=16)


@pytest.fixture(scope="module")
def ragged_dot_model(model_batch):
    return _loss_and_grads("ragged_dot", None, model_batch)


@pytest.mark.parametrize(
    "mesh, ep_size",
    [(None, 1), ((2, 2, 2), 4), ((8, 1, 1), 1)],
    ids=["one_device", "mesh_2x2x2_expert_parallel", "mesh_8x1x1_data_parallel"],
)
def test_model_loss_and_grads_match_ragged_dot(mesh, ep_size, model_batch, ragged_dot_model):
    """Pretraining loss and every parameter gradient equal the ragged_dot model's (float32).
    With expert parallelism the experts run on local shards inside the shard_map, where padding
    rows follow the groups; without it the rows stay sharded over the batch under plain jit."""
    layout = None
    if mesh is not None:
        replica, fsdp, cp = mesh
        layout = make_layout(config_lib.MeshConfig(replica=replica, fsdp=fsdp, cp=cp))
        assert layout.ep_size == ep_size
    want_loss, want_grads = ragged_dot_model
    loss, grads = _loss_and_grads("tiled", layout, model_batch)
    assert abs(loss - want_loss) < 1e-5 * abs(want_loss)
    errors = jax.tree.map(
        lambda a, b: np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30), grads, want_grads
    )
    assert max(jax.tree.leaves(errors)) < 1e-5, errors
    expert_grads = [g for g in jax.tree.leaves(grads) if g.ndim == 4]  # stacked [layers, E, ., .]
    assert expert_grads and all(np.abs(g).max() > 0 for g in expert_grads)
