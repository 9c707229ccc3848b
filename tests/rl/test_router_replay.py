"""Router replay on the RL side: the trainer recomputes the sampler's log-probs under the sampler's
experts, the plausibility filter replaces only implausible ones, and the RL loss trains the router.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import presets
from composer_jax.model import init_model
from composer_jax.model.moe import UNROUTED
from composer_jax.model.transformer import _run_layers, forward
from composer_jax.rl import (
    RLObjectiveConfig,
    SegmentKind,
    Sequence,
    pack_trajectories,
    policy_objective,
    reference_logprobs,
    rl_loss,
    token_logprobs,
    trainer_logits,
)

RATIO = 0.9
B, T, PROMPT = 4, 16, 4


@pytest.fixture(scope="module")
def setup():
    cfg = dataclasses.replace(
        presets.tiny().model,
        dtype="float32",
        num_layers=2,
        num_mtp_layers=0,
        replay_min_ratio=RATIO,
    )
    sampler = init_model(cfg, seed=0)
    tokens = jax.random.randint(jax.random.key(0), (B, T), 0, cfg.vocab_size)

    @jax.jit
    def sample(model, tokens):
        out = model(tokens, with_mtp=False)
        return model.logits(out.hidden_BTD), out.router_indices_LBTK

    logits, indices = sample(sampler, tokens)
    logp, indices = np.asarray(token_logprobs(logits, tokens)), np.asarray(indices)
    kinds = np.array([SegmentKind.PROMPT] * PROMPT + [SegmentKind.THINKING] * (T - PROMPT))
    sequences = []
    for b in range(B):
        seq = Sequence(
            sample_index=b,
            tokens=np.asarray(tokens[b]),
            kinds=kinds,
            policy_mask=kinds != SegmentKind.PROMPT,
            sampler_logprobs=logp[b],
            policy_versions=np.full(T, 7),
            router_indices=indices[:, b],
        )
        if b == 3:  # a flagged turn from token 8 on, with a 3-token hint before it
            seq.teacher_tokens = np.concatenate([seq.tokens[:8], [1, 2, 3], seq.tokens[8:]])
            seq.teacher_target_index = np.where(np.arange(T) >= 8, np.arange(T) + 3, -1)
        sequences.append(seq)
    rewards = {"task": np.array([1.0, 0.0, 0.5, -0.5])}
    batch = pack_trajectories(sequences, np.array([0, 0, 1, 1]), rewards, T, num_rows=B)
    return cfg, sampler, logits, batch


def _perturbed(model, scale=0.5):
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    router = copy.moe_layers.mlp.router
    router[...] = router[...] + scale * jax.random.normal(jax.random.key(1), router[...].shape)
    return copy


def test_replay_with_equal_weights_reproduces_sampler_exactly(setup):
    _, sampler, sampler_logits, batch = setup

    @jax.jit
    def recompute(model, batch):
        logits, metrics = trainer_logits(model, batch)
        return (
            logits,
            token_logprobs(logits, batch.tokens_BT),
            reference_logprobs(model, batch),
            metrics,
        )

    logits, logp, ref_logp, metrics = recompute(sampler, batch)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(sampler_logits))
    # The same logits to the bit; their log-softmax, compiled here inside a larger graph and
    # there op by op, may round the last bit differently.
    np.testing.assert_allclose(logp, batch.sampler_logprobs_BT, rtol=1e-6, atol=0)
    np.testing.assert_allclose(ref_logp, batch.sampler_logprobs_BT, rtol=1e-6, atol=0)
    assert float(metrics["router_replace_rate"]) == 0


def _moe_scores(model, batch):
    """The trainer's router scores at the (single) MoE layer, recomputed outside the model."""
    cfg = model.cfg
    x = model.embed_tokens(batch.tokens_BT)
    x, _ = _run_layers(model.dense_layers, x, batch.positions_BT, batch.segment_ids_BT, None, cfg)
    graphdef, state = nnx.split(model.moe_layers)
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
    h = x + block.attn(block.attn_norm(x), batch.positions_BT, batch.segment_ids_BT)[0]
    return jax.nn.sigmoid(block.mlp_norm(h) @ block.mlp.router[...])


@jax.jit
def _replayed(model, batch):
    """(metrics, the experts used at the MoE layer, its router scores) of a replayed forward."""
    _, metrics = trainer_logits(model, batch)
    out = model(
        batch.tokens_BT,
        batch.positions_BT,
        batch.segment_ids_BT,
        forced_indices_LBTK=batch.router_indices_LBTK,
        with_mtp=False,
    )
    return metrics, out.router_indices_LBTK[0], _moe_scores(model, batch)


def _implausible(cfg, forced, scores):
    kth_best = np.sort(scores, -1)[..., -cfg.num_experts_per_tok]
    return np.take_along_axis(scores, forced, -1) < RATIO * kth_best[..., None]


def test_perturbed_router_replaces_only_implausible_experts(setup):
    cfg, sampler, _, batch = setup
    metrics, used, scores = _replayed(_perturbed(sampler), batch)
    forced = np.asarray(batch.router_indices_LBTK[0])
    used, scores = np.asarray(used), np.asarray(scores)
    implausible = _implausible(cfg, forced, scores)
    np.testing.assert_array_equal(used != forced, implausible)
    rate = float(metrics["router_replace_rate"])
    np.testing.assert_allclose(rate, implausible.mean(), rtol=1e-6)
    assert 0 < rate < 1
    print(f"router replace rate under perturbed router weights: {rate:.3f}")


def test_an_unrouted_last_token_takes_the_trainers_own_experts_uncounted(setup):
    """A sequence's last token predicts nothing and the sampler never routed it (`UNROUTED`, as
    `Generation.to_sequence` leaves it): the trainer routes it by its own choice, and the replace
    rate counts only the routed tokens."""
    cfg, sampler, _, batch = setup
    forced = np.asarray(batch.router_indices_LBTK).copy()
    forced[:, :, -1] = UNROUTED
    batch = batch.replace(router_indices_LBTK=jnp.asarray(forced))
    for model in (sampler, _perturbed(sampler)):
        own = model(batch.tokens_BT, batch.positions_BT, batch.segment_ids_BT, with_mtp=False)
        metrics, used, scores = _replayed(model, batch)
        used, scores = np.asarray(used), np.asarray(scores)
        np.testing.assert_array_equal(used[:, -1], np.asarray(own.router_indices_LBTK[0])[:, -1])
        implausible = _implausible(cfg, forced[0, :, :-1], scores[:, :-1])
        np.testing.assert_array_equal(used[:, :-1] != forced[0, :, :-1], implausible)
        rate = float(metrics["router_replace_rate"])
        np.testing.assert_allclose(rate, implausible.mean(), rtol=1e-6)
        assert (rate == 0) == (model is sampler)


def test_rl_loss_jits_and_trains_the_router(setup):
    _, sampler, _, batch = setup
    trainer = _perturbed(sampler, scale=0.05)
    ref = batch.sampler_logprobs_BT  # the reference policy is the (unperturbed) sampler
    rl_cfg = RLObjectiveConfig(kl_coef=0.1, distill_coef=0.5, max_generation_len=T)
    graphdef, params, rest = nnx.split(trainer, nnx.Param, ...)

    @jax.jit
    def loss_and_grad(params, batch, ref):
        def loss(params):
            return rl_loss(nnx.merge(graphdef, params, rest), batch, rl_cfg, ref)

        return jax.value_and_grad(loss, has_aux=True)(params)

    (value, metrics), grads = loss_and_grad(params, batch, ref)
    assert np.isfinite(float(value))
    for name in (
        "pg_loss",
        "distill_loss",
        "kl_k1",
        "router_replace_rate",
        "importance_ratio_mean",
    ):
        assert np.isfinite(float(metrics[name])), name
    assert float(metrics["distill_loss"]) > 0
    assert int(metrics["policy_version_min"]) == int(metrics["policy_version_max"]) == 7
    router_grad = np.asarray(grads["moe_layers"]["mlp"]["router"][...])
    assert np.all(np.abs(router_grad).max(axis=(1, 2)) > 0)  # every MoE layer's router
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("replay", [True, False])
def test_rl_loss_is_the_objective_of_the_replayed_and_the_hinted_forwards(setup, replay):
    """rl_loss is policy_objective of the student's logits (with the sampler's experts forced
    when replaying, its own routing otherwise) and the teacher's logits on the hinted rows, each
    from a forward written out here; replay changes the loss (the router is perturbed)."""
    _, sampler, _, batch = setup
    trainer = _perturbed(sampler, scale=0.05)
    ref = batch.sampler_logprobs_BT
    rl_cfg = RLObjectiveConfig(
        kl_coef=0.1, distill_coef=0.5, max_generation_len=T, router_replay=replay
    )
    loss, _ = jax.jit(lambda b: rl_loss(trainer, b, rl_cfg, ref))(batch)

    def logits(tokens, positions, segments, forced=None):
        out = forward(
            trainer, tokens, positions, segments, forced_indices_LBTK=forced, with_mtp=False
        )
        return trainer.logits(out.hidden_BTD)

    forced = batch.router_indices_LBTK if replay else None
    student = logits(batch.tokens_BT, batch.positions_BT, batch.segment_ids_BT, forced)
    teacher = logits(
        batch.teacher_tokens_BT, batch.teacher_positions_BT, batch.teacher_segment_ids_BT
    )
    want, _ = policy_objective(student, batch, rl_cfg, ref, teacher_logits_BTV=teacher)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    other = dataclasses.replace(rl_cfg, router_replay=not replay)
    flipped, _ = jax.jit(lambda b: rl_loss(trainer, b, other, ref))(batch)
    assert not np.isclose(float(flipped), float(loss), rtol=1e-4)
