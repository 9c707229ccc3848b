"""Length penalty C(x): values, shape, the q -> 1 limit, and the reward components it feeds."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.rl import (
    LENGTH_FEATURES,
    RLObjectiveConfig,
    SegmentKind,
    Sequence,
    length_features,
    length_penalty,
    pack_trajectories,
    sample_rewards,
)

X = np.linspace(0, 50_000, 2001)
PARAMS = [(1e-3, 0.5), (1e-3, 1.5), (1e-4, 2.0), (5e-3, 1.0), (1e-2, 3.0)]


def _reference(x, k, q):
    x = np.asarray(x, np.float64)
    if q == 1:
        return np.log1p(k * x) / k
    return ((1 + k * x) ** (1 - q) - 1) / (k * (1 - q))


@pytest.mark.parametrize("k,q", PARAMS)
def test_values_match_float64(k, q):
    got = jax.jit(length_penalty, static_argnums=(1, 2))(jnp.asarray(X), k, q)
    np.testing.assert_allclose(got, _reference(X, k, q), rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("k,q", PARAMS)
def test_increasing_and_concave(k, q):
    x = np.linspace(0, 20 / k, 51)  # where float32 still resolves the curve's growth
    c = np.asarray(length_penalty(jnp.asarray(x), k, q), np.float64)
    assert c[0] == 0
    assert np.all(np.diff(c) > 0)
    chord_slopes = np.diff(c) / np.diff(x)
    assert np.all(np.diff(chord_slopes) < 0)  # concave
    # C'(x) = (1 + k x)^(-q): slope 1 at the origin, decreasing, so C(x) <= x.
    slope = jax.vmap(jax.grad(lambda v: length_penalty(v, k, q)))(jnp.asarray(x))
    np.testing.assert_allclose(slope, (1 + k * x) ** -q, rtol=1e-4)
    assert np.all(c <= x + 1e-3)


def test_larger_q_penalises_long_samples_less():
    curves = [np.asarray(length_penalty(jnp.asarray(X), 1e-3, q)) for q in (0.5, 1.0, 1.5, 2.5)]
    for lower_q, higher_q in zip(curves, curves[1:]):
        assert np.all(higher_q[1:] < lower_q[1:])


def test_q_to_one_limit():
    limit = _reference(X, 1e-3, 1.0)
    got = length_penalty(jnp.asarray(X), 1e-3, 1.0)
    np.testing.assert_allclose(got, limit, rtol=1e-5, atol=1e-3)
    for q in (1 - 1e-6, 1 + 1e-6, 1 + 1e-4):
        near = np.asarray(length_penalty(jnp.asarray(X), 1e-3, q))
        np.testing.assert_allclose(near, limit, rtol=2e-4 + 2 * abs(q - 1) * np.log1p(50))


def _chain_batch():
    """Sample 0: two generations joined by a summary; sample 1: one generation with a tool call."""
    K = SegmentKind
    gen1 = [K.PROMPT] * 3 + [K.THINKING] * 4 + [K.TOOL_CALL] * 2 + [K.TOOL_OUTPUT] * 5
    gen1 += [K.SUMMARY] * 3
    gen2 = [K.PROMPT] * 6 + [K.THINKING] * 2 + [K.FINAL_MESSAGE] * 4
    other = [K.PROMPT] * 2 + [K.TOOL_CALL] * 3 + [K.TOOL_OUTPUT] * 7 + [K.FINAL_MESSAGE] * 1
    sequences = []
    for sample, kinds in ((0, gen1), (0, gen2), (1, other)):
        kinds = np.asarray(kinds)
        n = len(kinds)
        sequences.append(
            Sequence(
                sample_index=sample,
                tokens=np.arange(n) % 5,
                kinds=kinds,
                policy_mask=(kinds != K.PROMPT) & (kinds != K.TOOL_OUTPUT),
                sampler_logprobs=np.full(n, -1.0),
                policy_versions=np.zeros(n, np.int32),
            )
        )
    rewards = {"task": np.array([1.0, 0.0]), "bad_tool_call": np.array([0.0, -0.5])}
    return pack_trajectories(
        sequences, np.array([0, 0]), rewards, 24, num_tool_calls=[1, 1], num_turns=[2, 1]
    )


def test_length_features_count_each_kind_over_a_chain():
    features = np.asarray(length_features(_chain_batch()))
    want = {
        "thinking": [6, 0],
        "tool_call": [2, 3],
        "tool_output": [5, 7],
        "final_message": [4, 1],
        "summary": [3, 0],
        "tool_calls": [1, 1],
        "turns": [2, 1],
    }
    for column, name in enumerate(LENGTH_FEATURES):
        np.testing.assert_array_equal(features[:, column], want[name], err_msg=name)


def test_rewards_combine_components_and_log_each():
    cfg = RLObjectiveConfig(
        length_penalty_coef=0.01,
        length_penalty_k=0.05,
        length_penalty_q=2.0,
        length_weight_tool_output=0.5,
        length_weight_per_tool_call=3.0,
        length_weight_per_turn=10.0,
    )
    total, metrics = jax.jit(sample_rewards, static_argnums=1)(_chain_batch(), cfg)
    x = np.array([6 + 2 + 2.5 + 4 + 3 + 3 + 20, 3 + 3.5 + 1 + 3 + 10])
    penalty = 0.01 * _reference(x, 0.05, 2.0)
    np.testing.assert_allclose(total, np.array([1.0, -0.5]) - penalty, rtol=1e-5)
    np.testing.assert_allclose(metrics["length_penalty"], penalty.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["reward/task"], 0.5)
    np.testing.assert_allclose(metrics["reward/bad_tool_call"], -0.25)
    np.testing.assert_allclose(metrics["length_x"], x.mean(), rtol=1e-6)
    no_penalty = dataclasses.replace(cfg, length_penalty_coef=0.0)
    np.testing.assert_allclose(sample_rewards(_chain_batch(), no_penalty)[0], [1.0, -0.5])
