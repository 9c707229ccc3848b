"""Policy-gradient estimator: expected gradient on the toy policy, importance weights, token
log-probs and group advantages against float64 references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.rl import group_advantages, policy_gradient_token_loss, token_logprobs
from tests.rl import toy

V = 6


def _problem(seed):
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=V).astype(np.float32)
    reward = rng.normal(size=V).astype(np.float32)
    pi = toy.softmax64(theta)
    grad_expected_reward = pi * (reward - pi @ reward)
    return theta, reward, grad_expected_reward


@pytest.mark.parametrize(
    "weighting,advantage_mode,factor",
    [
        ("truncated", "leave_one_out", 1.0),
        ("ppo_clip", "leave_one_out", 1.0),
        ("none", "mean", 0.75),
    ],
)
def test_on_policy_expected_gradient_is_gradient_of_expected_reward(
    weighting, advantage_mode, factor
):
    theta, reward, want = _problem(0)
    cfg = toy.config(importance_weighting=weighting, advantage_mode=advantage_mode)
    mean, se = toy.chunked_gradient(theta, theta, jnp.asarray(reward), cfg, jax.random.key(1))
    # Minimising the loss ascends the reward: loss gradient = -(G - 1)/G * grad E[R] ("mean").
    assert np.all(np.abs(mean + factor * want) < 4.5 * se + 1e-6), (mean, want, se)
    assert 4.5 * se.max() < 0.1 * np.abs(want).max()


def test_importance_weights_correct_off_policy_samples():
    """Samples from a stale policy, reweighted by pi/q (cap never reached): the expected gradient
    is the current policy's; without weights it is the stale one's, which differs."""
    theta, reward, want = _problem(2)
    stale = theta + np.random.default_rng(3).normal(size=V).astype(np.float32) * 0.5
    weighted = toy.config(importance_weighting="truncated", importance_cap=1e6)
    mean, se = toy.chunked_gradient(
        theta, theta, jnp.asarray(reward), weighted, jax.random.key(4), behaviour=stale
    )
    assert np.all(np.abs(mean + want) < 4.5 * se + 1e-6), (mean, want, se)
    unweighted, se_u = toy.chunked_gradient(
        theta, theta, jnp.asarray(reward), toy.config(), jax.random.key(4), behaviour=stale
    )
    assert np.abs(unweighted + want).max() > 10 * se_u.max()


def test_weightings_agree_on_policy():
    """At the sampling policy every ratio is 1: the three weightings give the same gradient."""
    theta, reward, _ = _problem(5)
    samples = jax.random.categorical(jax.random.key(6), jnp.asarray(theta), shape=(64,))
    batch = toy.one_step_batch(samples, jax.nn.log_softmax(theta), jnp.asarray(reward), 4)

    def grad(weighting):
        cfg = toy.config(importance_weighting=weighting)

        def loss(t):
            return toy.policy_objective(jnp.broadcast_to(t, (64, 2, V)), batch, cfg)[0]

        return np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(theta)))

    plain = grad("none")
    assert np.abs(plain).max() > 1e-3
    for weighting in ("truncated", "ppo_clip"):
        np.testing.assert_allclose(grad(weighting), plain, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("weighting", ["none", "truncated", "ppo_clip"])
def test_token_loss_and_gradient_match_float64(weighting):
    rng = np.random.default_rng(7)
    shape = (4, 50)
    logp = np.log(rng.uniform(0.05, 1, size=shape))
    sampler = logp + rng.normal(scale=0.5, size=shape)
    adv = rng.normal(size=shape)
    mask = rng.uniform(size=shape) < 0.8
    cfg = toy.config(importance_weighting=weighting, importance_cap=1.5)
    ratio = np.exp(logp - sampler)
    if weighting == "none":
        want, want_grad = -adv * logp, -adv
    elif weighting == "truncated":
        w = np.minimum(ratio, 1.5)
        want, want_grad = -w * adv * logp, -w * adv
    else:
        clipped = np.clip(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
        use_clipped = clipped * adv < ratio * adv
        want = -np.minimum(ratio * adv, clipped * adv)
        want_grad = np.where(use_clipped, 0.0, -ratio * adv)
    want, want_grad = np.where(mask, want, 0), np.where(mask, want_grad, 0)

    def total(lp):
        loss, metrics = policy_gradient_token_loss(
            lp, jnp.asarray(sampler, jnp.float32), jnp.asarray(adv, jnp.float32), mask, cfg
        )
        return loss.sum(), (loss, metrics)

    (_, (loss, metrics)), grad = jax.jit(jax.value_and_grad(total, has_aux=True))(
        jnp.asarray(logp, jnp.float32)
    )
    np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6)
    # The logged ratios are over the trained (masked) tokens only.
    adjusted = {"none": np.zeros(shape, bool), "truncated": ratio > 1.5}.get(weighting)
    if adjusted is None:
        adjusted = use_clipped
    np.testing.assert_allclose(metrics["importance_ratio_mean"], ratio[mask].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["importance_ratio_max"], ratio[mask].max(), rtol=1e-5)
    np.testing.assert_allclose(
        metrics["importance_adjusted_fraction"], adjusted[mask].mean(), rtol=1e-5
    )


def test_token_logprobs_match_float64():
    rng = np.random.default_rng(8)
    logits = rng.normal(size=(3, 9, 17)) * 4
    tokens = rng.integers(0, 17, size=(3, 9))
    got = jax.jit(token_logprobs)(jnp.asarray(logits, jnp.float32), jnp.asarray(tokens))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(got[:, 1:], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[:, 0], 0)


def _reference_advantages(rewards, groups, mode, eps):
    out = np.zeros_like(rewards)
    for g in set(groups) - {-1}:
        idx = np.flatnonzero(groups == g)
        r = rewards[idx]
        if mode == "leave_one_out":
            n = len(r)
            out[idx] = 0 if n == 1 else r - (r.sum() - r) / (n - 1)
        else:
            out[idx] = r - r.mean()
            if mode == "mean_std":
                out[idx] /= r.std() + eps
    return out


@pytest.mark.parametrize("mode", ["mean", "mean_std", "leave_one_out"])
def test_group_advantages_match_float64(mode):
    rng = np.random.default_rng(9)
    groups = np.repeat(np.arange(7), rng.integers(1, 6, size=7))
    groups = np.concatenate([rng.permutation(groups), [-1, -1]]).astype(np.int32)
    rewards = rng.normal(size=groups.size) * 3 + 1
    got = jax.jit(group_advantages, static_argnums=(2, 3))(
        jnp.asarray(rewards, jnp.float32), jnp.asarray(groups), mode, 1e-6
    )
    want = _reference_advantages(rewards, groups, mode, 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert np.abs(want).max() > 0.5


@pytest.mark.parametrize("advantage", [1.0, -1.0])
@pytest.mark.parametrize("weighting", ["none", "truncated", "ppo_clip"])
def test_a_token_far_off_policy_keeps_the_loss_and_gradient_finite(weighting, advantage):
    """A token the sampler gave log-prob -95 and the learner -2 (a stale sample or a sampler
    fault): exp of its log-ratio overflows float32, which made PPO's gradient NaN. Bounded, the
    loss and gradient are finite and the on-policy token's gradient is untouched."""
    cfg = toy.config(importance_weighting=weighting, importance_cap=1.5)
    sampler = jnp.array([[0.0, -95.0, -1.0]])
    mask = jnp.array([[False, True, True]])
    adv = jnp.full((1, 3), advantage)

    def total(lp):
        return policy_gradient_token_loss(lp, sampler, adv, mask, cfg)[0].sum()

    loss, grad = jax.jit(jax.value_and_grad(total))(jnp.array([[0.0, -2.0, -1.0]]))
    assert np.isfinite(loss) and np.all(np.isfinite(grad)), (loss, grad)
    assert grad[0, 2] == pytest.approx(-advantage)  # ratio 1: -A whatever the weighting
