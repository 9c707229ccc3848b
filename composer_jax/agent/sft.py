"""The agent's supervised warm start: what an SFT phase on `data.tasks` learns from.

`data.sft_style` "first_turn": (the first observation, a turn writing the oracle solution), text
pairs the chat format renders. "episode": the scripted agent (`agent.oracle`) plays each task
through the run's own workflow (`rl.agent`: its tools, turn limit, summary budget) in the real
environment, so every context it learns from is one RL will show it (tool outputs, summary
requests, restarts from task + summary); each generation of a solved episode is an example with
the loss on the agent's tokens. With `data.sft_repairs` some tasks also have an episode that
first edits a wrong body in, fails the visible tests and fixes it (the wrong edit is not
learned). With `data.sft_feedback` some make
one mistake a feedback detector flags (`agent.oracle.MISTAKES`): the mistaken turn is left out of
the loss, and each hinted one adds an example of the teacher context text-feedback distillation
uses (the generation up to the turn, the detector's hint) answered by the call the script meant.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from composer_jax import envs
from composer_jax.agent.feedback import IgnoredToolError, TurnRecord, render_hint
from composer_jax.agent.generation import hinted_turns
from composer_jax.agent.oracle import MISTAKES, OracleEngine, OracleScript
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
from composer_jax.envs.grading.protocol import UnrenderableError

log = logging.getLogger(__name__)


def episode_examples(
    agent: AgentConfig,
    rollout: RolloutConfig,
    model: ModelConfig,
    tokenizer: Tokenizer,
    tasks,
    env_threads: int = 2,
    feedback: float = 0.0,
    seed: int = 0,
    repairs: float = 0.0,
):
    """{"tokens", "loss_mask"} of every generation of the scripted agent's solved episodes, played
    in the RL sampler's slots and context (`rl.rollout`), the loss on the agent's tokens; a share
    `feedback` of the episodes (drawn with `seed`) makes one mistake, and adds the example of
    its hinted teacher answered right (`feedback_examples`); a share `repairs` of the tasks
    also has an episode that first edits a wrong body in, fails the tests and fixes it (the
    wrong edit left out of the loss), beside its clean one."""
    workflow, environment = build(
        agent,
        tokenizer,
        model,
        max_len=rollout.context_len,
        sampling=rollout_sampling(rollout),
        distill=feedback > 0,  # the hinted teacher contexts of the mistakes
    )
    kinds = _mistake_kinds(agent, feedback)
    scripts, repair_scripts = _scripts(tasks, environment, kinds, feedback, seed, repairs)
    # Two plays: the oracle engine tells scripts apart by their task's prompt, which a task's
    # repair shares with its clean episode.
    played = [
        pair
        for batch in (scripts, repair_scripts)
        if batch
        for pair in _play(batch, workflow, environment, tokenizer, rollout, model, env_threads)
    ]
    solved = [(o, s) for o, s in played if o.reward >= 1.0 and not o.truncated]
    if len(solved) < len(played):
        log.warning(
            "SFT episodes: the scripted agent solved %d of %d episodes; the others are left out "
            "(truncated: %d)",
            len(solved),
            len(played),
            sum(o.truncated for o, _ in played),
        )
    # A wrong body the visible tests miss would teach fixing what a passing test answered.
    kept = [(o, s) for o, s in solved if not s.repaired or _first_test_failed(o)]
    if len(kept) < len(solved):
        log.info(
            "SFT episodes: %d repairs left out (the tests passed the wrong body)",
            len(solved) - len(kept),
        )
    solved = kept
    summaries = sum(o.summaries for o, _ in solved)
    examples, hinted = [], 0
    repeats = IgnoredToolError.name in agent.feedback_detectors
    for outcome, script in solved:
        mistakes = [
            tuple(_turn_tokens(tokenizer, turn, rollout.max_new_tokens) for turn in pair)
            for pair in script.mistakes
        ]
        repeat_hint = None
        if mistakes and repeats:
            repeat_hint = _repeat_hint(outcome, tokenizer, environment.tools)
        for seq in outcome.sequences:
            generation, answered = feedback_examples(seq, mistakes, repeat_hint)
            examples += [generation, *answered]
            hinted += len(answered)
    log.info(
        "SFT episodes: %d generations of %d episodes (%d summaries, %d with a mistake, %d "
        "repaired; %d hinted examples)",
        summaries + len(solved),
        len(solved),
        summaries,
        sum(bool(s.mistakes) and not s.repaired for _, s in solved),
        sum(s.repaired for _, s in solved),
        hinted,
    )
    return examples


def _play(scripts, workflow, environment, tokenizer, rollout, model, env_threads) -> list:
    """(outcome, script) of each script played through the workflow in the RL sampler's slots."""
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
    return list(zip(outcomes, scripts))


def _first_test_failed(outcome) -> bool:
    """Whether the episode's first `run_tests` reported a failure."""
    codes = [c.exit_code for c in outcome.trace.tool_calls if c.tool == "run_tests"]
    return bool(codes) and codes[0] not in (0, None)


def _mistake_kinds(agent: AgentConfig, feedback: float) -> tuple[str, ...]:
    """The scripted mistakes the run's feedback detectors flag (an error when none is and
    `feedback` asks for mistakes)."""
    kinds = tuple(kind for kind, name in MISTAKES.items() if name in agent.feedback_detectors)
    if feedback > 0 and not kinds:
        raise ConfigError(
            "data.sft_feedback: rl.agent.feedback_detectors flags none of the scripted mistakes "
            f"(detectors {sorted(set(MISTAKES.values()))})"
        )
    return kinds


def _scripts(
    tasks, environment, kinds: tuple[str, ...], feedback: float, seed: int, repairs: float = 0.0
) -> tuple[list, list]:
    """(one script per task in `environment`, the repairs): a task whose solution the turn
    protocol cannot carry is left out with a warning; a share `feedback` of them (drawn with
    `seed`) makes one mistake of `kinds`; a share `repairs` of the tasks also has an episode
    that repairs a wrong first edit (where the change allows one)."""
    rng = np.random.default_rng(seed)
    repair_rng = np.random.default_rng([seed, 1])  # the mistakes' draws stay as they were
    scripts, repaired = [], []
    for task in tasks:
        mistake_rng = rng if rng.random() < feedback else None
        try:
            scripts.append(
                OracleScript(
                    task,
                    environment.tools,
                    environment.open_tab_lines,
                    mistake_rng=mistake_rng,
                    mistake_kinds=kinds,
                )
            )
        except UnrenderableError as error:
            log.warning("task %s: no scripted episode, left out (%s)", task.task_id, error)
            continue
        if repairs and repair_rng.random() < repairs:
            repair = OracleScript(
                task, environment.tools, environment.open_tab_lines, repair_rng=repair_rng
            )
            if repair.repaired:
                repaired.append(repair)
    return scripts, repaired


def _turn_tokens(tokenizer: Tokenizer, turn: str, max_new_tokens: int) -> np.ndarray:
    """A scripted turn's tokens as the oracle engine emits them."""
    return np.asarray(tokenizer.encode(turn)[:max_new_tokens], np.int32)


def _policy_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of the agent's tokens: one per turn."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def feedback_examples(
    seq, mistakes: list[tuple[np.ndarray, np.ndarray]], repeat_hint: np.ndarray | None = None
) -> tuple[dict, list]:
    """(the generation as an example, the loss on the agent's tokens but its scripted mistakes;
    the examples teaching the hints of each mistake answered by the call meant in the next
    turn: the hinted teacher context of the mistake (the generation up to it, the detector's
    hint), and with `repeat_hint` the context after the error with the hint a repeat of the
    failed call would get, each followed by that call, the loss on the call)."""
    loss = seq.policy_mask.astype(np.int32)
    hints = {}
    if seq.teacher_tokens is not None:
        turns = hinted_turns(seq.tokens, seq.teacher_tokens, seq.teacher_target_index)
        hints = {start: hint for start, _, hint in turns}
    runs = _policy_runs(seq.policy_mask)
    answered = []
    for i, (start, end) in enumerate(runs):
        pair = next((p for p in mistakes if np.array_equal(seq.tokens[start:end], p[0])), None)
        if pair is None:
            continue
        loss[start:end] = 0
        following = runs[i + 1] if i + 1 < len(runs) else None
        if following is None or not np.array_equal(seq.tokens[slice(*following)], pair[1]):
            continue
        if start in hints:
            answered.append(_answered(seq.tokens[:start], hints[start], pair[1]))
        if repeat_hint is not None:
            answered.append(_answered(seq.tokens[: following[0]], repeat_hint, pair[1]))
    return {"tokens": seq.tokens, "loss_mask": loss}, answered


def _answered(context: np.ndarray, hint: np.ndarray, turn: np.ndarray) -> dict:
    """The context, the hint and the turn, the loss on the turn."""
    prefix = np.concatenate([context, hint])
    return {
        "tokens": np.concatenate([prefix, turn]).astype(np.int32),
        "loss_mask": np.concatenate(
            [np.zeros(len(prefix), np.int32), np.ones(len(turn), np.int32)]
        ),
    }


def _repeat_hint(outcome, tokenizer: Tokenizer, tools: tuple[str, ...]) -> np.ndarray | None:
    """The hint `IgnoredToolError` gives a turn that repeats the episode's one failed
    call unchanged (None without exactly one)."""
    failed = [call for call in outcome.trace.tool_calls if not call.ok]
    if len(failed) != 1:
        return None
    turn = TurnRecord(0, "", (failed[0],), "", tools)
    hint = IgnoredToolError().check(turn, turn)
    return np.asarray(tokenizer.encode(render_hint([("", hint)])), np.int32)


def sft_examples(cfg: ExperimentConfig) -> Callable[[Tokenizer], list]:
    """What `run_pretraining(sft_examples=...)` calls for the examples of SFT phases: the first
    `data.sft_tasks` training tasks of `data.tasks` (seed cfg.seed) that have an oracle
    solution, in the run's `data.sft_style`. The source is checked now, before any training:
    a phase on it may start late in the run."""
    if any(phase.data == "tasks" for phase in cfg.train.phases):
        envs.task_source(cfg.data.tasks, "data.tasks")

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
        examples = episode_examples(
            cfg.rl.agent,
            cfg.rl.rollout,
            cfg.model,
            tokenizer,
            tasks,
            feedback=cfg.data.sft_feedback,
            seed=cfg.seed,
            repairs=cfg.data.sft_repairs,
        )
        if not examples:
            raise ConfigError(
                f"data.sft_style: the scripted agent solved none of {cfg.data.tasks!r}'s tasks"
            )
        return examples

    return make
