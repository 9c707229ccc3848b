"""Behaviour rewards in the objective and the report's objective as shipped defaults: the
recorded components, their weights, their place in the total reward and the metrics, the default
length penalty over the whole x, the plausibility filter on, Adam without weight decay for RL.
(The rewards themselves: tests/agent/test_rewards.py.)"""

import dataclasses

import numpy as np
import pytest

from composer_jax import presets
from composer_jax.actor.samples import groups_to_batch, make_group
from composer_jax.agent import EpisodeOutcome, reward_weights
from composer_jax.rl import RLObjectiveConfig, length_features, sample_rewards
from composer_jax.rl.length_penalty import length_weights, parts_advantage_rms
from tests.helpers import policy_sequence


def _sample(rng, reward, **behaviour):
    return EpisodeOutcome(
        [policy_sequence(rng, 6, 24)],
        reward=reward,
        num_turns=2,
        num_tool_calls=1,
        behaviour=behaviour,
    )


def test_weighted_components_enter_the_total_and_the_metrics():
    rng = np.random.default_rng()
    clean = {"answered": 0.0, "style": 0.0, "harm": 0.0}
    messy = {**clean, "answered": -1.0, "style": -0.5}
    samples = [_sample(rng, 1.0, **clean), _sample(rng, 1.0, **messy)]
    group = make_group("g0", "t0", samples)
    cfg = RLObjectiveConfig(length_penalty_coef=0.0)
    weights = reward_weights(("answered=0.05", "style=0.1", "harm=0.5"))
    batch = groups_to_batch([group], 64, reward_weights=weights)
    assert set(batch.rewards_N) == {"task", "answered", "style", "harm"}
    totals, metrics = sample_rewards(batch, cfg)
    np.testing.assert_allclose(np.asarray(totals)[:2], [1.0, 1.0 - 0.05 - 0.05], rtol=1e-6)
    assert metrics["reward/style"] == pytest.approx(-0.1 * 0.5 / 2)
    zero = reward_weights(("answered=0", "style=0", "harm=0"))
    off = groups_to_batch([group], 64, reward_weights=zero)
    assert set(off.rewards_N) == {"task"}
    unweighted = groups_to_batch([group], 64, reward_weights={"answered": 1.0})  # style not asked
    assert set(unweighted.rewards_N) == {"task", "answered"}


def test_length_penalty_counts_tool_calls_and_turns_by_default():
    cfg = RLObjectiveConfig()
    assert cfg.length_weight_per_tool_call > 0 and cfg.length_weight_per_turn > 0
    rng = np.random.default_rng()
    few = make_group("a", "t", [_sample(rng, 1.0)])
    many = dataclasses.replace(few, arrays={**few.arrays, "num_tool_calls": np.array([9.0])})
    x = [
        float(np.asarray(length_features(groups_to_batch([g], 64)))[0] @ length_weights(cfg))
        for g in (few, many)
    ]
    assert x[1] - x[0] == pytest.approx(8 * cfg.length_weight_per_tool_call)


@pytest.mark.parametrize("preset", ["rl_tiny", "rl_tiny_bpe", "rl_small"])
def test_rl_presets_ship_the_reports_defaults(preset):
    cfg = presets.PRESETS[preset]()
    assert cfg.model.replay_min_ratio > 0  # the plausibility filter is on
    assert cfg.optim.weight_decay == 0.0 and cfg.optim.name == "adamw"
    weights = reward_weights(cfg.rl.agent.behaviour_rewards)
    assert set(weights) >= {"style", "tool_misuse", "answered", "harm"}
    assert all(w > 0 for w in weights.values())


def test_each_rewards_share_of_the_advantage_is_its_spread_within_groups():
    # Two groups of three: the task reward is uniform in the first group (it
    # carries no advantage there), the style reward random; the metric is the root mean square
    # of each part minus its group's mean over valid samples, checked against numpy.
    rng = np.random.default_rng()
    style = -rng.uniform(0, 1, 6)
    task = np.array([1.0, 1.0, 1.0, *rng.uniform(0, 1, 3)])
    calls = rng.integers(0, 20, 6)  # the length penalty's spread
    groups = [
        make_group(
            f"g{g}",
            f"t{g}",
            [
                dataclasses.replace(
                    _sample(rng, task[3 * g + i], style=style[3 * g + i]),
                    num_tool_calls=int(calls[3 * g + i]),
                )
                for i in range(3)
            ],
        )
        for g in range(2)
    ]
    batch = groups_to_batch(groups, 64, reward_weights={"style": 0.1})
    cfg = RLObjectiveConfig()
    totals, _ = sample_rewards(batch, cfg)
    metrics = parts_advantage_rms(batch, cfg)
    group_of = np.repeat([0, 1], 3)

    def reference(part):
        means = np.array([part[group_of == g].mean() for g in (0, 1)])
        return np.sqrt(np.mean((part - means[group_of]) ** 2))

    assert float(metrics["advantage_rms/task"]) == pytest.approx(reference(task), rel=1e-5)
    assert float(metrics["advantage_rms/style"]) == pytest.approx(reference(0.1 * style), rel=1e-5)
    penalty = np.asarray(totals)[:6] - task - 0.1 * style
    assert float(metrics["advantage_rms/length_penalty"]) == pytest.approx(
        reference(penalty), rel=1e-4, abs=1e-7
    )
