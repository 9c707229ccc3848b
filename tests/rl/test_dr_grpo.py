"""Dr. GRPO properties of the objective on packed multi-token batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.rl import (
    SegmentKind,
    Sequence,
    group_advantages,
    pack_trajectories,
    policy_objective,
    sample_rewards,
    token_logprobs,
)
from tests.rl import toy

V = 7


def _batch(lengths, group_id, rewards, seed=0, seq_len=64):
    """One sequence per sample: 3 prompt tokens then `length` thinking tokens."""
    rng = np.random.default_rng(seed)
    sequences = []
    for i, length in enumerate(lengths):
        n = 3 + length
        kinds = np.full(n, SegmentKind.THINKING)
        kinds[:3] = SegmentKind.PROMPT
        sequences.append(
            Sequence(
                sample_index=i,
                tokens=rng.integers(0, V, size=n),
                kinds=kinds,
                policy_mask=kinds != SegmentKind.PROMPT,
                sampler_logprobs=np.log(rng.uniform(0.1, 1, size=n)),
                policy_versions=np.zeros(n, np.int32),
            )
        )
    return pack_trajectories(
        sequences, np.asarray(group_id), {"task": np.asarray(rewards)}, seq_len
    )


def _token_weights(batch, cfg):
    """-d loss / d log pi(y_t) per token, read off a policy with the same logits everywhere: the
    loss gradient at the predicting position is -weight * (onehot(y_t) - p)."""
    logits = jnp.asarray(np.random.default_rng(1).normal(size=V), jnp.float32)
    B, T = batch.tokens_BT.shape

    def loss(logits_BTV):
        return policy_objective(logits_BTV, batch, cfg)[0]

    grad = jax.jit(jax.grad(loss))(jnp.broadcast_to(logits, (B, T, V)))
    p_y = jax.nn.softmax(logits)[batch.tokens_BT]
    grad_y = jnp.take_along_axis(jnp.roll(grad, 1, axis=1), batch.tokens_BT[..., None], -1)[..., 0]
    return np.asarray(-grad_y / (1 - p_y))


def test_equal_rewards_in_a_group_give_zero_gradient():
    batch = _batch([5, 9, 2, 7, 4, 6], [0, 0, 0, 1, 1, 1], [1.0, 1.0, 1.0, -0.3, -0.3, -0.3])
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(*batch.tokens_BT.shape, V)))
    cfg = toy.config(importance_weighting="truncated", max_generation_len=16)
    grad = jax.jit(jax.grad(lambda x: policy_objective(x, batch, cfg)[0]))(logits)
    np.testing.assert_array_equal(np.asarray(grad), 0)
    changed = _batch([5, 9, 2, 7, 4, 6], [0, 0, 0, 1, 1, 1], [1.0, 1.5, 1.0, -0.3, -0.3, -0.3])
    grad = jax.jit(jax.grad(lambda x: policy_objective(x, changed, cfg)[0]))(logits)
    assert np.abs(np.asarray(grad)).max() > 1e-4


@pytest.mark.parametrize("mode", ["mean", "leave_one_out", "mean_std"])
def test_a_group_of_equal_random_rewards_has_exactly_zero_advantages(mode):
    """Equal rewards whose float32 mean is not exactly themselves (most are, in groups of 8 or
    16): no advantage, in any mode; other groups' advantages match a float64 reference."""
    rng = np.random.default_rng()
    equal = rng.random(64).astype(np.float32)
    rewards = np.concatenate([equal.repeat(8), equal[:32].repeat(16), rng.random(12)])
    groups = np.concatenate(
        [np.arange(64).repeat(8), 64 + np.arange(32).repeat(16), 96 + np.arange(3).repeat(4)]
    )
    groups[-1] = -1  # an empty slot
    adv = np.asarray(group_advantages(jnp.asarray(rewards), jnp.asarray(groups), mode))
    np.testing.assert_array_equal(adv[: 64 * 8 + 32 * 16], 0.0)
    tail, g = rewards[-12:-1].astype(np.float64), groups[-12:-1]
    for group in np.unique(g):
        r = tail[g == group]
        want = {
            "mean": r - r.mean(),
            "leave_one_out": r - (r.sum() - r) / (len(r) - 1),
            "mean_std": (r - r.mean()) / (r.std() + 1e-6),
        }[mode]
        np.testing.assert_allclose(adv[-12:-1][g == group], want, rtol=1e-5, atol=1e-6)
    assert adv[-1] == 0.0


@pytest.mark.parametrize("mode", ["mean", "leave_one_out"])
def test_per_token_weight_does_not_depend_on_sequence_length(mode):
    """Every policy token of sample i weighs A_i / constant, however long its sequence."""
    groups, rewards = [0, 0, 0, 1, 1], [1.0, 0.0, 0.5, 2.0, -1.0]
    cfg = toy.config(advantage_mode=mode, max_generation_len=40)
    advantages = np.asarray(group_advantages(jnp.asarray(rewards), jnp.asarray(groups), mode))
    weights = {}
    for scale in (1, 3):
        batch = _batch([4 * scale, 2 * scale, 5 * scale, 3 * scale, 1 * scale], groups, rewards)
        w = _token_weights(batch, cfg)
        mask = np.asarray(batch.policy_mask_BT)
        sample = np.asarray(batch.sample_index_BT)
        want = advantages[sample] / (5 * 40)
        np.testing.assert_allclose(w[mask], want[mask], rtol=1e-4, atol=1e-7)
        weights[scale] = {i: np.unique(np.round(w[mask & (sample == i)], 6)) for i in range(5)}
    for i in range(5):
        assert len(weights[1][i]) == 1
        np.testing.assert_allclose(weights[1][i], weights[3][i], rtol=1e-4)


def test_advantages_stay_small_for_groups_with_tiny_spread():
    rng = np.random.default_rng(3)
    groups = np.repeat(np.arange(8), 8).astype(np.int32)
    spread = 1e-6
    rewards = rng.normal(size=8).repeat(8) + spread * rng.uniform(size=64)
    for mode in ("mean", "leave_one_out"):
        adv = np.asarray(group_advantages(jnp.asarray(rewards), jnp.asarray(groups), mode))
        assert np.abs(adv).max() <= 2 * spread
    # The std-normalised ablation turns the same noise into unit-sized advantages.
    adv = np.asarray(group_advantages(jnp.asarray(rewards), jnp.asarray(groups), "mean_std", 1e-6))
    assert np.abs(adv).max() > 0.1


def test_the_logged_advantage_rms_is_the_advantages_and_each_parts():
    # Total and per-part rms as logged by the objective, the KL (k1, in the reward) included,
    # against numpy: each part centred on its group's mean over the 6 samples, the KL summed
    # over each sample's trainable tokens (policy tokens predicted inside their own sequence).
    rng = np.random.default_rng()
    groups = np.array([0, 0, 0, 1, 1, 1])
    rewards = rng.uniform(-1, 1, 6)
    batch = _batch(list(rng.integers(1, 12, 6)), groups, rewards, seq_len=128)
    cfg = toy.config(
        advantage_mode="mean", length_penalty_coef=0.05, max_generation_len=16, kl_coef=0.02
    )
    logits = jnp.asarray(rng.normal(size=(*batch.tokens_BT.shape, V)), jnp.float32)
    ref = jnp.asarray(rng.normal(scale=0.5, size=batch.tokens_BT.shape) - 2.0, jnp.float32)
    _, metrics = policy_objective(logits, batch, cfg, ref_logprobs_BT=ref)

    logp = np.asarray(token_logprobs(logits, batch.tokens_BT), np.float64)
    segments, sample = np.asarray(batch.segment_ids_BT), np.asarray(batch.sample_index_BT)
    same = np.pad(segments[:, 1:] == segments[:, :-1], ((0, 0), (1, 0)))
    mask = np.asarray(batch.policy_mask_BT) & same & (segments > 0) & (sample >= 0)
    k1 = logp - np.asarray(ref, np.float64)
    kl = np.array([k1[mask & (sample == i)].sum() for i in range(6)])
    totals, _ = sample_rewards(batch, cfg)  # the rewards less the length penalty
    penalty = rewards - np.asarray(totals)[:6]

    def rms(part):
        centred = part - np.array([part[groups == g].mean() for g in (0, 1)])[groups]
        return np.sqrt(np.mean(centred**2))

    np.testing.assert_allclose(metrics["kl_k1"], k1[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["advantage_rms/kl"], rms(cfg.kl_coef * kl), rtol=1e-4)
    np.testing.assert_allclose(metrics["advantage_rms/length_penalty"], rms(penalty), rtol=1e-4)
    total = rewards - penalty - cfg.kl_coef * kl
    np.testing.assert_allclose(metrics["advantage_rms/total"], rms(total), rtol=1e-4)
    assert metrics["advantage_rms/kl"] > 0 and metrics["advantage_rms/length_penalty"] > 0
