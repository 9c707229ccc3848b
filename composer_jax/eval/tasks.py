"""A model on coding tasks: K sampled episodes per task through the real environments, graded,
reported as pass@k / best-of-K with 95% intervals over tasks, tokens, turns, tool calls, flags,
the graders' scores (state tracking: similarity), broken down by a task's metadata."""

from __future__ import annotations

import dataclasses
import threading
import time

from tqdm.auto import tqdm

from composer_jax import envs
from composer_jax.actor.rollout import EpisodeTrace, play_episodes
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


def evaluate_tasks(
    model,
    tokenizer,
    tasks: list[envs.Task],
    cfg: TaskEvalConfig = TaskEvalConfig(),
    env_config: envs.EnvConfig = envs.EnvConfig(),
    progress: bool = True,
) -> dict:
    """The report of `passk.evaluate` plus "timing" (seconds generating and in environments)."""
    if cfg.samples < 1:
        raise ValueError(f"samples ({cfg.samples}) must be >= 1")
    ks = tuple(k for k in cfg.ks if k <= cfg.samples)
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
    env_seconds = [0.0]  # summed over the episodes' steps, which overlap each other and decoding
    lock = threading.Lock()

    def timed_step(episode: envs.Episode, text: str):
        begun = time.perf_counter()
        try:
            return envs.Episode.step(episode, text)
        finally:
            with lock:
                env_seconds[0] += time.perf_counter() - begun

    episodes = [task for task in tasks for _ in range(cfg.samples)]
    started = time.perf_counter()
    with tqdm(total=len(episodes), desc="evaluate", unit="episode", disable=not progress) as bar:
        rewards = []

        def finished(trace: EpisodeTrace) -> None:
            rewards.append(trace.reward)
            bar.update(1)
            bar.set_postfix(reward=f"{sum(rewards) / len(rewards):.3f}")

        traces = play_episodes(
            engine,
            episodes,
            sampling,
            cfg.max_turns,
            tokenizer,
            env_config,
            cfg.seed,
            env_threads=cfg.env_workers,
            on_finish=finished,
            step=timed_step,
        )
    records = [
        EpisodeRecord(
            task_id=task.task_id,
            reward=float(trace.reward),
            tokens=trace.generated_tokens,
            tool_calls=int(trace.counts.get("tool_calls", 0)),
            flagged=bool(trace.flags),
            turns=int(trace.counts.get("turns", 0)),
            scores=dict((trace.grade or {}).get("scores", {})),
            group=task.group,
        )
        for task, trace in zip(episodes, traces)
    ]
    report = evaluate(records, ks)
    total = time.perf_counter() - started
    report["timing"] = {
        "total_seconds": total,
        "environment_seconds": env_seconds[0],  # tool commands and grading, summed
        "generation_seconds": total - env_seconds[0],
    }
    return report
