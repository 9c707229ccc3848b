"""The pretraining loss against numpy references, and the sharded step against one device."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import config as config_lib
from composer_jax import optim, presets
from composer_jax.model import init_model
from composer_jax.model.layers import logical_axes_of
from composer_jax.parallel import make_layout
from composer_jax.train import step as S
from composer_jax.train.loop import state_shardings
from tests.train.helpers import small_model_config


def _model_cfg(**kw):
    return small_model_config(num_experts=4, dtype="float32", **kw)


def _packed_batch(rng, B=8, T=24, vocab=259):
    """Rows of 1-3 random documents each, plus right padding in some rows."""
    tokens = rng.integers(0, vocab, (B, T)).astype(np.int32)
    segments = np.zeros((B, T), np.int32)
    positions = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(2, T - 2), rng.integers(0, 3), replace=False))
        end = T - rng.integers(0, 5)
        bounds = [0, *cuts, end]
        for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            segments[b, lo:hi] = s + 1
            positions[b, lo:hi] = np.arange(hi - lo)
    return {"tokens": tokens, "segment_ids": segments, "positions": positions}


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_shift_targets_matches_reference():
    rng = np.random.default_rng(0)
    batch = _packed_batch(rng)
    for shift in (1, 2, 3):
        targets, mask = S.shift_targets(
            jnp.asarray(batch["tokens"]), jnp.asarray(batch["segment_ids"]), shift
        )
        seg = batch["segment_ids"]
        B, T = seg.shape
        for b in range(B):
            for t in range(T):
                ok = t + shift < T and seg[b, t] > 0 and seg[b, t + shift] == seg[b, t]
                assert bool(mask[b, t]) == ok
                if ok:
                    assert int(targets[b, t]) == batch["tokens"][b, t + shift]


@pytest.mark.parametrize("mtp_loss", ["distill", "ce"])
def test_pretrain_loss_matches_numpy(mtp_loss):
    cfg = _model_cfg(num_mtp_layers=2)
    m = init_model(cfg, seed=1)
    batch = _packed_batch(np.random.default_rng(2))
    train_cfg = dataclasses.replace(config_lib.TrainConfig(), mtp_loss=mtp_loss, mtp_weight=0.7)
    loss, metrics = S.pretrain_loss(m, {k: jnp.asarray(v) for k, v in batch.items()}, train_cfg)

    out = m(
        jnp.asarray(batch["tokens"]),
        jnp.asarray(batch["positions"]),
        jnp.asarray(batch["segment_ids"]),
    )
    main_logp = _log_softmax(np.asarray(m.logits(out.hidden_BTD), np.float64))
    tokens, seg = batch["tokens"], batch["segment_ids"]
    B, T = tokens.shape

    def valid(b, t, shift):
        return t + shift < T and seg[b, t] > 0 and seg[b, t + shift] == seg[b, t]

    ce = [-main_logp[b, t, tokens[b, t + 1]] for b in range(B) for t in range(T) if valid(b, t, 1)]
    np.testing.assert_allclose(metrics["ce"], np.mean(ce), rtol=1e-5)
    depth_losses = []
    for d, h in enumerate(out.mtp_hidden_DBTD, start=1):
        student = _log_softmax(np.asarray(m.head(h), np.float64))
        terms = []
        for b in range(B):
            for t in range(T):
                if not valid(b, t, 1 + d):
                    continue
                if mtp_loss == "ce":
                    terms.append(-student[b, t, tokens[b, t + 1 + d]])
                else:
                    teacher = main_logp[b, t + d]
                    terms.append(np.sum(np.exp(teacher) * (teacher - student[b, t])))
        depth_losses.append(np.mean(terms))
    np.testing.assert_allclose(metrics["mtp"], np.mean(depth_losses), rtol=1e-5)
    np.testing.assert_allclose(loss, np.mean(ce) + 0.7 * np.mean(depth_losses), rtol=1e-5)


def _run_steps(cfg, layout, batches, microbatches=1, qk_clip=None, metrics_out=None):
    train_cfg = config_lib.TrainConfig()
    opt_cfg = config_lib.OptimizerConfig(warmup_steps=1)
    schedule = optim.learning_rate_schedule(opt_cfg, 10)
    m = init_model(cfg, seed=3)
    graphdef, params, _ = S.split_model(m)
    optimizer = optim.make_optimizer(opt_cfg, schedule, logical_axes_of(params), verbose=False)
    state = S.init_train_state(m, optimizer)
    shardings = state_shardings(jax.eval_shape(lambda: state), layout)
    state = jax.device_put(state, shardings)
    step = jax.jit(
        functools.partial(
            S.train_step,
            graphdef,
            optimizer,
            cfg,
            train_cfg,
            schedule,
            layout,
            microbatches=microbatches,
            qk_clip=qk_clip,
        ),
        in_shardings=(shardings, layout.batch_sharding()),
    )
    losses = []
    for b in batches:
        state, metrics = step(state, jax.device_put(b, layout.batch_sharding()))
        losses.append(float(metrics["loss"]))
        if metrics_out is not None:
            metrics_out.append(jax.device_get(metrics))
    return losses, state


def test_a_state_of_committed_weights_compiles_the_step_once():
    """Weights committed to a device (a loaded checkpoint's) with new step and optimizer counters:
    without committing those too, jit traces the step again on its own (committed) output."""
    cfg = _model_cfg()
    m = init_model(cfg, seed=0)
    nnx.update(m, jax.device_put(nnx.state(m), jax.devices()[0]))
    opt_cfg = config_lib.OptimizerConfig(warmup_steps=1)
    schedule = optim.learning_rate_schedule(opt_cfg, 10)
    graphdef, params, _ = S.split_model(m)
    optimizer = optim.make_optimizer(opt_cfg, schedule, logical_axes_of(params), verbose=False)
    traces = []

    def step(state, batch):
        traces.append(1)
        return S.train_step(graphdef, optimizer, cfg, config_lib.TrainConfig(), schedule, None,
                            state, batch)  # fmt: skip

    state = S.init_train_state(m, optimizer)
    assert all(leaf.committed for leaf in jax.tree.leaves(state))
    jitted = jax.jit(step)
    batch = jax.tree.map(jnp.asarray, _packed_batch(np.random.default_rng(0), B=2, T=8))
    for _ in range(3):
        state, _ = jitted(state, batch)
    assert len(traces) == 1


def test_expert_bias_moves_towards_balance():
    """One step moves each bias by rate * sign(mean load - load), load from the forward pass."""
    cfg = _model_cfg()
    batch = _packed_batch(np.random.default_rng(5), B=8, T=16)
    out = init_model(cfg, seed=3)(
        *(jnp.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids"))
    )
    load = np.asarray(out.expert_load_LE)
    valid = (batch["segment_ids"] > 0).sum() * cfg.num_experts_per_tok
    np.testing.assert_allclose(load.sum(-1), valid)
    layout = make_layout(config_lib.MeshConfig(fsdp=1), devices=jax.devices()[:1])
    _, state = _run_steps(cfg, layout, [batch])
    bias = np.asarray(state.buffers["moe_layers"]["mlp"]["expert_bias"][...])
    want = cfg.router_bias_update_rate * np.sign(load.mean(-1, keepdims=True) - load)
    np.testing.assert_allclose(bias, want, atol=1e-7)
    assert np.any(bias > 0) and np.any(bias < 0)


def test_loss_mask_limits_the_targets():
    """With a loss mask (SFT), only the marked target tokens enter the cross-entropy."""
    cfg = _model_cfg(num_mtp_layers=0)
    m = init_model(cfg, seed=1)
    batch = _packed_batch(np.random.default_rng(6))
    rng = np.random.default_rng(7)
    batch["loss_mask"] = (rng.uniform(size=batch["tokens"].shape) < 0.5).astype(np.int32)
    _, metrics = S.pretrain_loss(
        m, {k: jnp.asarray(v) for k, v in batch.items()}, config_lib.TrainConfig()
    )
    out = m(*(jnp.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids")))
    logp = _log_softmax(np.asarray(m.logits(out.hidden_BTD), np.float64))
    tokens, seg, mask = batch["tokens"], batch["segment_ids"], batch["loss_mask"]
    B, T = tokens.shape
    terms = [
        -logp[b, t, tokens[b, t + 1]]
        for b in range(B)
        for t in range(T - 1)
        if seg[b, t] > 0 and seg[b, t + 1] == seg[b, t] and mask[b, t + 1]
    ]
    np.testing.assert_allclose(metrics["ce"], np.mean(terms), rtol=1e-5)
    assert metrics["tokens"] == len(terms)


@pytest.mark.parametrize("microbatches", [2, 4])
def test_microbatches_accumulate_the_whole_batchs_gradient(microbatches):
    """Gradients accumulated over micro-batches (rows of different token counts, a loss mask,
    MTP) are the whole batch's: the same metrics, and the same gradients as one pass."""
    cfg = _model_cfg(balance_loss_alpha=0.1)
    m = init_model(cfg, seed=4)
    graphdef, params, buffers = S.split_model(m)
    state = S.TrainState(jnp.zeros((), jnp.int32), params, buffers, None)
    rng = np.random.default_rng(8)
    batch = _packed_batch(rng, B=8, T=24)
    batch["loss_mask"] = (rng.uniform(size=batch["tokens"].shape) < 0.7).astype(np.int32)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    train_cfg = config_lib.TrainConfig()
    whole_metrics, whole = S.loss_gradients(
        graphdef, None, state, lambda model: S.pretrain_loss(model, batch, train_cfg)
    )
    metrics, grads = jax.jit(
        lambda st, b: S.accumulated_gradients(graphdef, None, st, b, train_cfg, 1, microbatches)
    )(state, batch)
    for name in ("loss", "ce", "mtp", "balance_loss", "tokens", "expert_load"):
        np.testing.assert_allclose(metrics[name], whole_metrics[name], rtol=2e-5, atol=1e-7)
    maxima, whole_maxima = metrics[S.ATTENTION_MAX_LOGITS], whole_metrics[S.ATTENTION_MAX_LOGITS]
    assert set(maxima) == set(whole_maxima)
    for path in maxima:
        np.testing.assert_allclose(maxima[path], whole_maxima[path], rtol=1e-6, err_msg=path)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(whole)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)


def test_microbatched_step_on_8_devices_equals_one_pass_on_one():
    """A step of 2 micro-batches on fsdp=4 x cp=2 gives the one-device, one-pass step (the
    balance loss on: its rows' sums span the cp shards). The gradient norm is compared too:
    AdamW's update (and global-norm clipping) hides a gradient scaled by a constant, as a sum
    over micro-batches instead of their mean would be."""
    cfg = small_model_config(dtype="float32", balance_loss_alpha=0.1)  # 8 experts, one a device
    batches = [_packed_batch(np.random.default_rng(s), B=8, T=32) for s in (11, 12)]
    one = make_layout(config_lib.MeshConfig(fsdp=1), devices=jax.devices()[:1])
    eight = make_layout(config_lib.MeshConfig(fsdp=4, cp=2), devices=jax.devices()[:8])
    want_metrics, got_metrics = [], []
    want_losses, want = _run_steps(cfg, one, batches, metrics_out=want_metrics)
    got_losses, got = _run_steps(cfg, eight, batches, microbatches=2, metrics_out=got_metrics)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for g, w in zip(got_metrics, want_metrics):
        np.testing.assert_allclose(g["grad_norm"], w["grad_norm"], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_a_qk_clipped_step_on_8_devices_equals_one_device():
    """QK-clip on fsdp=4 x cp=2 in 2 micro-batches (maxima over sequence shards and micro-
    batches) rescales the same heads by the same factors as on one device in one pass."""
    cfg = small_model_config(dtype="float32")
    batches = [_packed_batch(np.random.default_rng(s), B=8, T=32) for s in (13, 14)]
    one = make_layout(config_lib.MeshConfig(fsdp=1), devices=jax.devices()[:1])
    eight = make_layout(config_lib.MeshConfig(fsdp=4, cp=2), devices=jax.devices()[:8])
    clip = optim.QKClip(0.5, cfg.qk_nope_head_dim)
    want_metrics, got_metrics = [], []
    want_losses, want = _run_steps(cfg, one, batches, qk_clip=clip, metrics_out=want_metrics)
    got_losses, got = _run_steps(cfg, eight, batches, 2, clip, got_metrics)
    assert all(m["qk_clipped_heads"] > 0 for m in want_metrics)
    for w, g in zip(want_metrics, got_metrics):
        np.testing.assert_allclose(g["grad_norm"], w["grad_norm"], rtol=1e-4)
        assert g["qk_clipped_heads"] == w["qk_clipped_heads"]
        np.testing.assert_allclose(g["attention_max_logit"], w["attention_max_logit"], rtol=1e-5)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_the_balance_loss_adds_alpha_times_its_mean_and_trains_only_through_the_router():
    """With one MoE layer, the balance term changes the loss by alpha x the logged mean over rows
    and the gradients of the router and everything before it, never that layer's experts'."""
    cfg = _model_cfg(num_mtp_layers=0)
    _, params, buffers = S.split_model(init_model(cfg, seed=2))
    batch = {k: jnp.asarray(v) for k, v in _packed_batch(np.random.default_rng(9)).items()}
    results = {}
    for alpha in (0.0, 0.5):
        on = dataclasses.replace(cfg, balance_loss_alpha=alpha)
        state = S.TrainState(jnp.zeros((), jnp.int32), params, buffers, None)
        results[alpha] = S.loss_gradients(
            S.split_model(init_model(on, seed=2))[0],
            None,
            state,
            lambda m: S.pretrain_loss(m, batch, config_lib.TrainConfig()),
        )
    (off_metrics, off), (on_metrics, on) = results[0.0], results[0.5]
    assert "balance_loss" not in off_metrics and on_metrics["balance_loss"] > 0.9
    np.testing.assert_allclose(
        on_metrics["loss"] - off_metrics["loss"], 0.5 * on_metrics["balance_loss"], rtol=1e-5
    )
    moe_off, moe_on = off["moe_layers"]["mlp"], on["moe_layers"]["mlp"]
    for name in ("gate", "up", "down"):
        np.testing.assert_allclose(moe_on[name][...], moe_off[name][...], rtol=1e-6, atol=1e-9)
    assert np.abs(moe_on["router"][...] - moe_off["router"][...]).max() > 1e-6


def test_microbatches_must_split_the_phases_batch():
    tiny = presets.tiny()
    phases = (dataclasses.replace(tiny.train.phases[0], microbatches=3), *tiny.train.phases[1:])
    cfg = dataclasses.replace(tiny, train=dataclasses.replace(tiny.train, phases=phases))
    with pytest.raises(config_lib.ConfigError, match=r"phases\[0\].batch_size.* x microbatches=3"):
        config_lib.validate(cfg, num_devices=1)
