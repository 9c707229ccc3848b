"""Behaviour rewards and the report's objective as shipped defaults: components from what an
episode did, their weights, their place in the total reward and the metrics, the default length
penalty over the whole x, the plausibility filter on, Adam without weight decay for RL."""

import dataclasses

import numpy as np
import pytest

from composer_jax import config
from composer_jax.actor.samples import SampleResult, groups_to_batch, make_group
from composer_jax.rl import RLObjectiveConfig, length_features, sample_rewards
from composer_jax.rl.batch import SegmentKind, Sequence
from composer_jax.rl.length_penalty import length_weights
from composer_jax.rl.rewards import (
    BEHAVIOUR_REWARDS,
    EpisodeBehaviour,
    behaviour_rewards,
    reward_weights,
)


def test_components_follow_what_the_episode_did():
    clean = behaviour_rewards(EpisodeBehaviour(turns=3, tool_calls=4, answered=True))
    assert clean == dict.fromkeys(BEHAVIOUR_REWARDS, 0.0)
    messy = behaviour_rewards(
        EpisodeBehaviour(
            turns=4,
            tool_calls=2,
            feedback={"style": 1, "unknown_tool": 1, "invalid_arguments": 3},
            answered=False,
            flagged=True,
        )
    )
    assert messy == {"style": -0.25, "tool_misuse": -1.0, "communication": -1.0, "harm": -1.0}


def _sample(rng, reward, **behaviour):
    n = 30
    policy = np.arange(n) >= 6
    seq = Sequence(
        sample_index=0,
        tokens=rng.integers(3, 259, n).astype(np.int32),
        kinds=np.where(policy, SegmentKind.THINKING, SegmentKind.PROMPT).astype(np.int32),
        policy_mask=policy,
        sampler_logprobs=np.where(policy, -0.3, 0.0).astype(np.float32),
        policy_versions=np.zeros(n, np.int32),
        router_indices=np.zeros((1, n, 2), np.int32),
    )
    return SampleResult([seq], reward=reward, num_turns=2, num_tool_calls=1, **behaviour)


def test_weighted_components_enter_the_total_and_the_metrics():
    rng = np.random.default_rng()
    samples = [
        _sample(rng, 1.0, answered=True),
        _sample(rng, 1.0, answered=False, feedback={"style": 2}),
    ]
    group = make_group("g0", "t0", samples)
    cfg = RLObjectiveConfig(length_penalty_coef=0.0)
    batch = groups_to_batch([group], 64, reward_weights=reward_weights(cfg))
    assert set(batch.rewards_N) == {"task", *BEHAVIOUR_REWARDS}
    totals, metrics = sample_rewards(batch, cfg)
    want_second = 1.0 - cfg.reward_weight_communication - cfg.reward_weight_style
    np.testing.assert_allclose(np.asarray(totals)[:2], [1.0, want_second], rtol=1e-6)
    assert metrics["reward/style"] == pytest.approx(-cfg.reward_weight_style / 2)
    zero = dataclasses.replace(cfg, **{f"reward_weight_{n}": 0.0 for n in BEHAVIOUR_REWARDS})
    off = groups_to_batch([group], 64, reward_weights=reward_weights(zero))
    assert set(off.rewards_N) == {"task"}


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
    cfg = config.PRESETS[preset]()
    assert cfg.model.replay_min_ratio > 0  # the plausibility filter is on
    assert cfg.optim.weight_decay == 0.0 and cfg.optim.name == "adamw"
    assert all(getattr(cfg.rl, f"reward_weight_{n}") > 0 for n in BEHAVIOUR_REWARDS)
