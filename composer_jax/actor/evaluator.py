"""The evaluator role: mean reward on held-out tasks, with a confidence interval.

Held-out tasks come from a task source (`rl.heldout_tasks`, split `rl.heldout_split`, seeds the
warm start and the RL prompts never use: `setup.heldout_task_set`). Each task is sampled `samples` times with the RL sampling settings; the task is
the unit of the interval (samples of one task are not independent), and a before/after comparison
is paired by task.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from composer_jax.actor.rollout import episode_stats, play_groups, sampler_engine
from composer_jax.config import RLConfig
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.envs import EnvConfig, Task
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

    @property
    def mean(self) -> float:
        return float(self.per_task.mean())

    @property
    def half_width(self) -> float:
        """95% Student-t half-width over tasks."""
        return t_half_width(self.per_task)

    def __str__(self) -> str:
        return f"{self.mean:.3f} +- {self.half_width:.3f} (95% CI, pass rate {self.pass_rate:.2f})"

    def improvement_over(self, before: "HeldoutResult") -> tuple[float, float]:
        """Mean paired difference (self - before) over tasks and its 95% Student-t half-width."""
        diff = self.per_task - before.per_task
        return float(diff.mean()), t_half_width(diff)


class Evaluator:
    """Plays `samples` episodes of every held-out task with a fresh engine on the given model:
    the sampler's engine settings (prefill buckets, decode steps per call), slots refilled as
    episodes end, environment steps on `rl.num_env_workers` threads."""

    def __init__(
        self,
        cfg: RLConfig,
        tasks: list[Task],
        tokenizer: Tokenizer,
        samples: int,
        temperature: float,
        env_config: EnvConfig = EnvConfig(),
        seed: int = 0,
    ):
        self.cfg, self.tasks, self.tokenizer = cfg, tasks, tokenizer
        self.samples, self.temperature, self.seed = samples, temperature, seed
        self.env_config = env_config

    def evaluate(self, model: Transformer) -> HeldoutResult:
        cfg = self.cfg
        engine = sampler_engine(model, cfg, self.tokenizer)
        sampling = SamplingParams(
            temperature=self.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            seed=self.seed,
        )
        # Rewards only: no sequences are built, so a prompt that leaves no room to answer
        # scores 0 (with a warning) instead of failing the evaluation.
        traces = play_groups(
            engine,
            self.tasks,
            self.samples,
            sampling,
            cfg.max_turns,
            self.tokenizer,
            env_config=self.env_config,
            env_threads=cfg.num_env_workers,
        )
        stats = episode_stats(traces)
        rewards = stats["reward"].reshape(len(self.tasks), self.samples)
        return HeldoutResult(rewards.mean(axis=1), float((rewards >= 1.0).mean()))
