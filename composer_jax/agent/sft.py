"""The agent's supervised warm start: what an SFT phase on `data.tasks` learns from.

`data.sft_style` "first_turn": (the first observation, a turn writing the oracle solution), text
pairs the chat format renders. "episode": the scripted agent (`agent.oracle`) plays each task
through the run's own workflow (`rl.agent`: its tools, turn limit, summary budget) in the real
environment, so every context it learns from is one RL will show it (tool outputs, summary
requests, restarts from task + summary); each generation of a solved episode is an example with
the loss on the agent's tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from composer_jax import envs
from composer_jax.agent.oracle import OracleEngine, OracleScript
from composer_jax.agent.play import play, rollout_sampling
from composer_jax.agent.setup import build, env_config
from composer_jax.config import (
    AgentConfig,
    ConfigError,
    ExperimentConfig,
    ModelConfig,
    RolloutConfig,
)
from composer_jax.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def episode_examples(
    agent: AgentConfig,
    rollout: RolloutConfig,
    model: ModelConfig,
    tokenizer: Tokenizer,
    tasks,
    env_threads: int = 2,
):
    """{"tokens", "loss_mask"} of every generation of the scripted agent's solved episodes, played
    in the RL sampler's slots and context (`rl.rollout`); no teacher contexts (`distill`): an
    example is the agent's own tokens."""
    workflow, environment = build(
        agent,
        tokenizer,
        model,
        max_len=rollout.context_len,
        sampling=rollout_sampling(rollout),
        distill=False,
    )
    scripts = [OracleScript(t, environment.tools, environment.open_tab_lines) for t in tasks]
    engine = OracleEngine(
        scripts,
        tokenizer,
        rollout.num_slots,
        rollout.context_len,
        model.num_moe_layers,
        model.num_experts_per_tok,
    )
    jobs = [(script.task, f"oracle-{i}") for i, script in enumerate(scripts)]
    outcomes = play(engine, jobs, workflow, environment, env_threads=env_threads)
    solved = [o for o in outcomes if o.reward >= 1.0 and not o.truncated]
    if len(solved) < len(outcomes):
        log.warning(
            "SFT episodes: the scripted agent solved %d of %d tasks; the others are left out "
            "(truncated: %d)",
            len(solved),
            len(outcomes),
            sum(o.truncated for o in outcomes),
        )
    summaries = sum(o.summaries for o in solved)
    log.info(
        "SFT episodes: %d generations of %d episodes (%d summaries)",
        summaries + len(solved),
        len(solved),
        summaries,
    )
    return [
        {"tokens": seq.tokens, "loss_mask": seq.policy_mask.astype(np.int32)}
        for outcome in solved
        for seq in outcome.sequences
    ]


def sft_examples(cfg: ExperimentConfig) -> Callable[[Tokenizer], list]:
    """What `run_pretraining(sft_examples=...)` calls for the examples of SFT phases: the first
    `data.sft_tasks` training tasks of `data.tasks` (seed cfg.seed) that have an oracle
    solution, in the run's `data.sft_style`."""

    def make(tokenizer: Tokenizer) -> list:
        drawn = envs.drawn_tasks(
            cfg.data.tasks, "data.tasks", cfg.data.sft_tasks, "train", cfg.seed
        )
        tasks = [task for task in drawn if task.oracle_files]
        if not tasks:
            raise ConfigError(
                f"data.tasks: {cfg.data.tasks!r} has no training task with an oracle solution"
            )
        if cfg.data.sft_style == "first_turn":
            return [envs.sft_example(task, env_config(cfg.rl.agent)) for task in tasks]
        examples = episode_examples(cfg.rl.agent, cfg.rl.rollout, cfg.model, tokenizer, tasks)
        if not examples:
            raise ConfigError(
                f"data.sft_style: the scripted agent solved none of {cfg.data.tasks!r}'s tasks"
            )
        return examples

    return make
