"""The expert exchange under a capacity factor: which slots it drops, what it computes for the
rest, its gradients, and the training metrics that report it (8 simulated devices)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import config as config_lib
from composer_jax.config import TrainConfig
from composer_jax.model import init_model
from composer_jax.parallel import expert_parallel, make_layout, report, use_layout
from composer_jax.parallel.mesh import Layout
from composer_jax.train import step as S
from tests.parallel.test_layouts import _loss_grads_logits, _model_cfg, _rel
from tests.train.test_step import _packed_batch

B, T, D, F, E, K = 8, 6, 16, 8, 8, 2
MESH = (2, 2, 2)  # replica, fsdp, cp: expert-parallel groups of fsdp x cp = 4 devices


def _inputs(seed: int):
    """Tokens, a validity mask with padding, skewed top-k routing (so members overflow) and
    expert weights, all float32."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    valid = rng.random((B, T)) < 0.8
    skew = np.linspace(2.0, 0.0, E)  # low expert ids (the first member) are popular
    noise = rng.gumbel(size=(B, T, E))
    indices = np.argsort(-(skew + noise), axis=-1)[..., :K].astype(np.int32)
    weights = rng.random((B, T, K)).astype(np.float32)
    gate, up = (rng.normal(size=(E, D, F)).astype(np.float32) / 4 for _ in range(2))
    down = rng.normal(size=(E, F, D)).astype(np.float32) / 3
    return tuple(map(jnp.asarray, (x, valid, indices, weights, gate, up, down)))


def _swiglu(rows, gate, up, down):
    return (jax.nn.silu(rows @ gate) * (rows @ up)) @ down


def _local_experts(rows_MD, expert_M, gate, up, down):
    """Each row through its local expert, densely (ids past the last expert give zeros)."""
    here = expert_M < gate.shape[0]
    e = jnp.minimum(expert_M, gate.shape[0] - 1)
    h = jax.nn.silu(jnp.einsum("md,mdf->mf", rows_MD, gate[e]))
    h = h * jnp.einsum("md,mdf->mf", rows_MD, up[e])
    return jnp.where(here[:, None], jnp.einsum("mf,mfd->md", h, down[e]), 0.0)


def _expected_drops(valid, indices, factor):
    """The capacity rule written out per device: in each device's block of tokens, the slots
    bound for each member in token order, valid ones first; the first ceil(factor x slots /
    group) of them travel."""
    replica, fsdp, cp = MESH
    group, b, t = fsdp * cp, B // (replica * fsdp), T // cp
    slots = b * t * K
    cap = slots if factor is None else min(slots, math.ceil(factor * slots / group))
    dropped = np.zeros((B, T, K), bool)
    for row_block in range(replica * fsdp):
        for col_block in range(cp):
            rows = slice(row_block * b, (row_block + 1) * b)
            cols = slice(col_block * t, (col_block + 1) * t)
            member = np.asarray(indices[rows, cols]) // (E // group)
            ok = np.broadcast_to(np.asarray(valid[rows, cols])[..., None], member.shape)
            block = np.zeros(member.shape, bool).reshape(-1)
            for m in range(group):
                bound = np.flatnonzero(member.reshape(-1) == m)
                ranked = np.concatenate(
                    [bound[ok.reshape(-1)[bound]], bound[~ok.reshape(-1)[bound]]]
                )
                block[ranked[cap:]] = True
            dropped[rows, cols] = block.reshape(member.shape)
    return dropped


def _reference(x, indices, weights, gate, up, down, dropped):
    """Every kept slot's expert output times its weight, summed over slots, on one device."""
    out = jax.vmap(_swiglu, in_axes=(None, 0, 0, 0))(x.reshape(-1, D), gate, up, down)  # [E, BT, D]
    per_slot = out[indices.reshape(-1, K), jnp.arange(B * T)[:, None]]  # [BT, K, D]
    kept = weights.reshape(-1, K) * (1.0 - dropped.reshape(-1, K))
    return jnp.einsum("skd,sk->sd", per_slot, kept).reshape(B, T, D)


def _layout(dispatch: str, factor) -> Layout:
    replica, fsdp, cp = MESH
    mesh = config_lib.MeshConfig(
        replica=replica, fsdp=fsdp, cp=cp, ep_dispatch=dispatch, ep_quantize="none"
    )
    layout = make_layout(mesh)
    return Layout(layout.mesh, layout.ep_axes, "none", dispatch, factor)


@pytest.mark.parametrize("dispatch", ["padded", "ragged_emulated"])
@pytest.mark.parametrize("factor", [None, 0.5, 1.0, 1.5])
def test_capacity_drops_the_written_out_rule_and_computes_the_rest(dispatch, factor):
    """Outputs, drop masks and gradients (tokens, mixing weights, expert weights) equal a
    one-device reference that applies the rule written out; factor None drops nothing."""
    x, valid, indices, weights, gate, up, down = _inputs(seed=3)
    layout = _layout(dispatch, factor)
    want_dropped = _expected_drops(valid, indices, factor)
    assert (factor is None) == (not want_dropped.any()), "the routing must overflow at c <= 1.5"

    def ours(x, weights, gate, up, down):
        out, dropped = expert_parallel.routed_experts(
            x, valid, indices, weights, gate, up, down, layout, _local_experts
        )
        return jnp.sum(out * jnp.cos(out)), (out, dropped)

    def reference(x, weights, gate, up, down):
        out = _reference(x, indices, weights, gate, up, down, jnp.asarray(want_dropped))
        return jnp.sum(out * jnp.cos(out)), out

    argnums = (0, 1, 2, 3, 4)
    args = (x, weights, gate, up, down)
    (_, (out, dropped)), grads = jax.jit(jax.value_and_grad(ours, argnums, has_aux=True))(*args)
    (_, want_out), want_grads = jax.value_and_grad(reference, argnums, has_aux=True)(*args)
    np.testing.assert_array_equal(np.asarray(dropped), want_dropped)
    assert _rel(np.asarray(out), np.asarray(want_out)) < 1e-5
    for got, want in zip(grads, want_grads):
        assert _rel(np.asarray(got), np.asarray(want)) < 1e-5


def test_capacity_shrinks_the_exchange_buffers():
    """The compiled exchange moves group / factor times fewer bytes than the dropless one."""
    x, valid, indices, weights, gate, up, down = _inputs(seed=4)

    def all_to_all_bytes(factor):
        layout = _layout("padded", factor)
        run = jax.jit(lambda *a: expert_parallel.routed_experts(*a, layout, _local_experts))
        text = run.lower(x, valid, indices, weights, gate, up, down).compile().as_text()
        return report.collective_bytes(text)["all-to-all"]

    assert all_to_all_bytes(1.0) * 4 == all_to_all_bytes(None)


@pytest.fixture(scope="module")
def batch():
    return _packed_batch(np.random.default_rng(0), B=8, T=16)


def _drop_rate_and_loss(layout, batch):
    m = init_model(_model_cfg("float32"), seed=5)
    graphdef, params, buffers = S.split_model(m)

    def f(params, buffers, batch):
        with use_layout(layout):
            return S.pretrain_loss(nnx.merge(graphdef, params, buffers), batch, TrainConfig())

    loss, metrics = jax.jit(f)(params, buffers, batch)
    scalars = {k: v for k, v in metrics.items() if k not in ("expert_load", S.ATTENTION_MAX_LOGITS)}
    return float(loss), {k: float(v) for k, v in scalars.items()}


def test_training_reports_drops_and_matches_one_device_when_nothing_can_drop(batch):
    """A factor of the group size can drop nothing: the step equals one device's with a drop
    rate of 0; at 0.25 slots are dropped, the loss moves, and the metric says how many."""
    want_loss, want_grads, want_logits, _ = _loss_grads_logits(_model_cfg("float32"), None, batch)
    _, one_device_metrics = _drop_rate_and_loss(None, batch)
    assert "expert_drop_rate" not in one_device_metrics  # nothing to drop, nothing reported
    roomy = make_layout(config_lib.MeshConfig(replica=2, fsdp=2, cp=2, ep_capacity=4.0))
    loss, grads, logits, _ = _loss_grads_logits(_model_cfg("float32"), roomy, batch)
    assert abs(loss - want_loss) / abs(want_loss) < 1e-5 and _rel(logits, want_logits) < 1e-5
    assert max(jax.tree.leaves(jax.tree.map(_rel, grads, want_grads))) < 1e-5
    assert _drop_rate_and_loss(roomy, batch)[1]["expert_drop_rate"] == 0
    tight = make_layout(config_lib.MeshConfig(replica=2, fsdp=2, cp=2, ep_capacity=0.25))
    tight_loss, metrics = _drop_rate_and_loss(tight, batch)
    assert 0.5 < metrics["expert_drop_rate"] < 1 and tight_loss != pytest.approx(want_loss)


def test_micro_batches_report_the_whole_batchs_drop_rate(batch):
    """Each micro-batch's drops over the whole batch's routed slots: the accumulated rate is
    the micro-batches' rates weighted by their tokens (their sum, before: twice the rate)."""
    tight = make_layout(config_lib.MeshConfig(replica=2, fsdp=2, cp=2, ep_capacity=0.25))
    m = init_model(_model_cfg("float32"), seed=5)
    graphdef, params, buffers = S.split_model(m)
    state = S.TrainState(jnp.zeros((), jnp.int32), params, buffers, None)
    metrics, _ = jax.jit(
        lambda state, batch: S.accumulated_gradients(
            graphdef, tight, state, batch, TrainConfig(), m.cfg.num_mtp_layers, 2
        )
    )(state, batch)
    rates, tokens = [], []
    for k in range(2):  # micro-batch k: rows k, k + 2, ... (`split_microbatches`)
        half = jax.tree.map(lambda x: x[k::2], batch)
        rates.append(_drop_rate_and_loss(tight, half)[1]["expert_drop_rate"])
        tokens.append(int(np.sum(np.asarray(half["segment_ids"]) > 0)))
    want = np.dot(rates, tokens) / np.sum(tokens)
    assert 0.5 < want < 1
    np.testing.assert_allclose(float(metrics["expert_drop_rate"]), want, rtol=1e-5)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf")])
def test_a_capacity_that_is_not_a_positive_number_is_refused(bad):
    cfg = config_lib.ExperimentConfig(mesh=config_lib.MeshConfig(ep_capacity=bad))
    with pytest.raises(ValueError, match="mesh.ep_capacity"):
        config_lib.validate(cfg)
