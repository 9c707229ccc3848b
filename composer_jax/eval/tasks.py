"""A model on coding tasks: K sampled episodes per task through the real environments, played by
the run's agent workflow (the episode training plays), graded, reported as pass@k / best-of-K with
95% intervals over tasks, tokens, turns, tool calls, summaries, feedback turns, behaviour rewards,
flags, the graders' scores (state tracking: similarity), broken down by a task's metadata, and
where the episodes stopped (`agent.stages`)."""

from __future__ import annotations

import dataclasses
import threading
import time

from tqdm.auto import tqdm

from composer_jax import agent, envs
from composer_jax.agent import stages
from composer_jax.config import RLConfig
from composer_jax.eval.passk import EpisodeRecord, evaluate
from composer_jax.infer import InferenceEngine, SamplingParams


@dataclasses.dataclass(frozen=True)
class TaskEvalConfig:
    samples: int = 4  # K episodes per task
    ks: tuple[int, ...] = (1, 2, 4)
    temperature: float = 1.0
    top_p: float = 1.0
    max_turns: int = 2
    max_new_tokens: int = 256  # per turn
    context_len: int = 1024
    num_slots: int = 16
    env_workers: int = 4  # environment steps (tool commands, grading) run this many at a time
    seed: int = 0
    require_isolation: bool = True


def _record(task: envs.Task, outcome: agent.EpisodeOutcome) -> EpisodeRecord:
    scores = dict((outcome.grade or {}).get("scores", {}))
    scores.update({f"behaviour_{name}": value for name, value in outcome.behaviour.items()})
    scores.update(summaries=outcome.summaries, feedback_turns=sum(outcome.feedback.values()))
    return EpisodeRecord(
        task_id=task.task_id,
        reward=float(outcome.reward),
        tokens=outcome.policy_tokens,
        tool_calls=outcome.num_tool_calls,
        flagged=outcome.flagged,
        turns=outcome.num_turns,
        scores=scores,
        group=task.group,
    )


def evaluate_tasks(
    model,
    tokenizer,
    tasks: list[envs.Task],
    cfg: TaskEvalConfig = TaskEvalConfig(),
    rl: RLConfig = RLConfig(),
    progress: bool = True,
) -> dict:
    """The report of `passk.evaluate` plus "stages" (`agent.stages.stage_breakdown`) and
    "timing" (seconds generating and in environments).
    `rl.agent` gives the agent (workflow, tools of its evaluation profile, summaries, feedback,
    behaviour rewards); `cfg` the sampling and the episode budget."""
    if cfg.samples < 1:
        raise ValueError(f"samples ({cfg.samples}) must be >= 1")
    ks = tuple(k for k in cfg.ks if k <= cfg.samples)
    agent_cfg = dataclasses.replace(rl.agent, max_turns=cfg.max_turns)
    environment = agent.env_config(
        agent_cfg, evaluation=True, require_isolation=cfg.require_isolation
    )
    engine = InferenceEngine(
        model,
        num_slots=cfg.num_slots,
        max_len=cfg.context_len,
        prefill_buckets=tuple(sorted({64, 256, cfg.context_len} - {0})),
        tokenizer=tokenizer,
    )
    sampling = SamplingParams(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
        seed=cfg.seed,
    )
    workflow = agent.make_workflow(
        agent_cfg,
        tokenizer,
        model.cfg,
        environment,
        max_len=cfg.context_len,
        sampling=sampling,
        distill=rl.objective.distill_coef > 0,
    )
    jobs = agent.group_jobs(tasks, cfg.samples)
    outcomes, timing = _play_timed(engine, jobs, workflow, environment, cfg, progress)
    played = [(task, outcome) for (task, _), outcome in zip(jobs, outcomes)]
    report = evaluate([_record(task, outcome) for task, outcome in played], ks)

    def visible(task: envs.Task, files: dict[str, str]) -> bool | None:
        return envs.visible_test_passes(task, files, require_isolation=cfg.require_isolation)

    report["stages"] = stages.stage_breakdown(played, visible, environment.open_tab_lines)
    report["timing"] = timing
    return report


def _play_timed(engine, jobs, workflow, environment, cfg: TaskEvalConfig, progress: bool):
    """(the episodes' outcomes, their timing: total, in environments summed over the episodes'
    steps, which overlap each other and decoding, and the rest as generation), with a progress
    bar of the mean reward."""
    env_seconds = [0.0]
    lock = threading.Lock()

    def timed_step(episode: envs.Episode, text: str):
        begun = time.perf_counter()
        try:
            return envs.Episode.step(episode, text)
        finally:
            with lock:
                env_seconds[0] += time.perf_counter() - begun

    started = time.perf_counter()
    with tqdm(total=len(jobs), desc="evaluate", unit="episode", disable=not progress) as bar:
        rewards = []

        def finished(index: int, outcome: agent.EpisodeOutcome) -> None:
            rewards.append(outcome.reward)
            bar.update(1)
            bar.set_postfix(reward=f"{sum(rewards) / len(rewards):.3f}")

        outcomes = agent.play(
            engine,
            jobs,
            workflow,
            environment,
            env_threads=cfg.env_workers,
            on_finish=finished,
            step=timed_step,
        )
    total = time.perf_counter() - started
    return outcomes, {
        "total_seconds": total,
        "environment_seconds": env_seconds[0],  # tool commands and grading, summed
        "generation_seconds": total - env_seconds[0],
    }
