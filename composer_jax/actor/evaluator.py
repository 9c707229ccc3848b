"""The evaluator role: held-out tasks played through the run's workflow, with confidence intervals.

Held-out tasks come from a task source (`rl.heldout.tasks`, split `rl.heldout.split`, seeds the
warm start and the RL prompts never use: `setup.heldout_task_set`). Each task is sampled `samples`
times through `agent.play` with the run's workflow (the episode training plays: turns, summaries,
feedback, behaviour rewards) in the evaluation tool profile. The task is the unit of every
interval (samples of one task are not independent), and a before/after comparison is paired by
task; sample j of task i draws the same random numbers before and after.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from composer_jax.agent import episode_stats, group_jobs, make_workflow, play, sampler_engine
from composer_jax.config import RLConfig
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.envs import EnvConfig, Task
from composer_jax.eval.passk import best_of_k, paired_by_task
from composer_jax.infer import SamplingParams
from composer_jax.model.transformer import Transformer


def t_half_width(values: np.ndarray, confidence: float = 0.95) -> float:
    """Half-width of the two-sided interval of the mean by Student's t (tasks are few; the normal
    quantile would understate it); NaN for fewer than two values."""
    n = len(values)
    if n < 2:
        return float("nan")
    from scipy import stats

    quantile = float(stats.t.ppf(0.5 + confidence / 2, n - 1))
    return quantile * float(np.std(values, ddof=1)) / math.sqrt(n)


@dataclasses.dataclass(frozen=True)
class HeldoutResult:
    per_task: np.ndarray  # mean reward of each task's samples
    pass_rate: float  # share of samples with reward 1
    # Per-task means of what the episodes did (pass@1, best_of_<K>, turns, tool_calls,
    # summaries, feedback_turns, reward/<behaviour>), each [tasks].
    metrics: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    task_ids: tuple[str, ...] = ()  # of per_task's entries (empty in records kept before)

    @property
    def mean(self) -> float:
        return float(self.per_task.mean())

    @property
    def half_width(self) -> float:
        """95% Student-t half-width over tasks."""
        return t_half_width(self.per_task)

    def __str__(self) -> str:
        return f"{self.mean:.3f} +- {self.half_width:.3f} (95% CI, pass rate {self.pass_rate:.2f})"

    def improvement_over(self, before: "HeldoutResult", metric: str = "") -> tuple[float, float]:
        """Mean paired difference (self - before) over the tasks both hold of the reward (or of
        `metric`) and its 95% Student-t half-width."""
        mine = self.metrics[metric] if metric else self.per_task
        theirs = before.metrics[metric] if metric else before.per_task
        mine, theirs = paired_by_task(self.task_ids, mine, before.task_ids, theirs)
        diff = mine - theirs
        return float(diff.mean()), t_half_width(diff)

    def paired_tasks(self, before: "HeldoutResult") -> int:
        """How many tasks `improvement_over(before)` pairs."""
        return len(
            paired_by_task(self.task_ids, self.per_task, before.task_ids, before.per_task)[0]
        )


def per_task_metrics(outcomes, num_tasks: int, samples: int) -> dict[str, np.ndarray]:
    """The per-task means of `HeldoutResult.metrics` from `samples` outcomes per task, in task
    order."""
    stats = episode_stats(outcomes)
    per_sample = {
        "pass@1": (stats["reward"] >= 1.0).astype(np.float32),
        "turns": stats["num_turns"],
        "tool_calls": stats["num_tool_calls"],
        "summaries": stats["summaries"],
        "feedback_turns": stats["feedback_turns"],
    }
    for name in sorted({name for o in outcomes for name in o.behaviour}):
        per_sample[f"reward/{name}"] = np.array([o.behaviour.get(name, 0.0) for o in outcomes])
    metrics = {k: v.reshape(num_tasks, samples).mean(axis=1) for k, v in per_sample.items()}
    if samples > 1:
        rewards = stats["reward"].reshape(num_tasks, samples)
        metrics[f"best_of_{samples}"] = np.array([best_of_k(list(r), samples) for r in rewards])
    return metrics


class Evaluator:
    """Plays `samples` episodes of every held-out task with a fresh engine on the given model:
    the sampler's engine settings (prefill buckets, decode steps per call), slots refilled as
    episodes end, environment steps on `rl.rollout.num_env_workers` threads."""

    def __init__(
        self,
        cfg: RLConfig,
        tasks: list[Task],
        tokenizer: Tokenizer,
        samples: int,
        temperature: float,
        env_config: EnvConfig,
        seed: int = 0,
    ):
        self.cfg, self.tasks, self.tokenizer = cfg, tasks, tokenizer
        self.samples, self.temperature, self.seed = samples, temperature, seed
        self.env_config = env_config

    def evaluate(self, model: Transformer) -> HeldoutResult:
        cfg = self.cfg
        rollout = cfg.rollout
        engine = sampler_engine(model, rollout, self.tokenizer)
        sampling = SamplingParams(
            temperature=self.temperature,
            top_p=rollout.top_p,
            max_new_tokens=rollout.max_new_tokens,
            seed=self.seed,
        )
        workflow = make_workflow(
            cfg.agent,
            self.tokenizer,
            model.cfg,
            self.env_config,
            max_len=rollout.context_len,
            sampling=sampling,
            distill=cfg.objective.distill_coef > 0,
        )
        outcomes = play(
            engine,
            group_jobs(self.tasks, self.samples),
            workflow,
            self.env_config,
            env_threads=rollout.num_env_workers,
        )
        rewards = episode_stats(outcomes)["reward"].reshape(len(self.tasks), self.samples)
        metrics = per_task_metrics(outcomes, len(self.tasks), self.samples)
        return HeldoutResult(
            rewards.mean(axis=1),
            float((rewards >= 1.0).mean()),
            metrics,
            tuple(task.task_id for task in self.tasks),
        )
