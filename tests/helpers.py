"""The shared test helpers: the tiny preset's model in float32 with overrides, and the flags of
a `launch.rl` run small enough for a test."""

import dataclasses

from composer_jax import config, presets


def tiny_model_config(**overrides) -> config.ModelConfig:
    """`presets.tiny().model` in float32 compute, with `overrides` (shapes, layers, routing)."""
    return dataclasses.replace(presets.tiny().model, **{"dtype": "float32", **overrides})


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
