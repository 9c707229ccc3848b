"""The shared test helpers: the tiny preset's model in float32 with overrides, one sampled
sequence of an episode, and the flags of a `launch.rl` run small enough for a test."""

import dataclasses

import numpy as np
import pytest

from composer_jax import config, presets
from composer_jax.envs.sandbox import isolation
from composer_jax.rl.batch import SegmentKind, Sequence

# The isolating sandbox backends, each skipped where it cannot run.
ISOLATING = [
    pytest.param(
        name, marks=pytest.mark.skipif(not isolation.usable(name), reason=f"{name} not usable here")
    )
    for name in ("bwrap", "unshare")
]


def tiny_model_config(**overrides) -> config.ModelConfig:
    """`presets.tiny().model` in float32 compute, with `overrides` (shapes, layers, routing)."""
    return dataclasses.replace(presets.tiny().model, **{"dtype": "float32", **overrides})


def policy_sequence(rng, prompt_len: int, policy_len: int, versions=None) -> Sequence:
    """One sequence: `prompt_len` prompt tokens, then `policy_len` thinking tokens the policy
    sampled (log-prob -0.5 each, at `versions`, default 0)."""
    n = prompt_len + policy_len
    policy = np.arange(n) >= prompt_len
    return Sequence(
        sample_index=0,
        tokens=rng.integers(3, 259, n).astype(np.int32),
        kinds=np.where(policy, SegmentKind.THINKING, SegmentKind.PROMPT).astype(np.int32),
        policy_mask=policy,
        sampler_logprobs=np.where(policy, -0.5, 0.0).astype(np.float32),
        policy_versions=np.zeros(n, np.int32) if versions is None else versions,
        router_indices=np.zeros((1, n, 2), np.int32),
    )


# A `launch.rl` subprocess run in seconds: a 2-step warm start, one-turn episodes of 16 tokens in
# groups of 2 on 4 slots, every group trained, 2 held-out tasks, thread environment workers. A
# test adds its workdir, steps and what it is about.
SMALL_RL_FLAGS = (
    "--config.rl.heldout.num_tasks=2",
    "--config.rl.heldout.samples=1",
    "--config.rl.warm_start_steps=2",
    "--config.rl.rollout.group_size=2",
    "--config.rl.rollout.num_slots=4",
    "--config.rl.rollout.context_len=512",
    "--config.rl.rollout.max_new_tokens=16",
    "--config.rl.agent.max_turns=1",
    "--config.rl.rollout.skip_uniform_groups=False",
    "--config.rl.rollout.env_workers=thread",
    "--progress=false",
)
