"""pass@k and best-of-K from n samples per task, with the unbiased estimators, and a report.

pass@k = E[1 - C(n - c, k) / C(n, k)]: the chance that at least one of k samples drawn without
replacement from the n passes (Chen et al. 2021). best-of-K = the expected maximum reward of K
samples drawn without replacement: sum_i r_(i) C(i - 1, K - 1) / C(n, K) over rewards sorted
ascending (1-based i), which reduces to pass@k for 0/1 rewards. Plain Python: no JAX needed.
"""

import dataclasses
import json
import math
from math import comb

import numpy as np
from etils import epath


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k for one task."""
    if not 0 <= num_correct <= num_samples or not 1 <= k <= num_samples:
        raise ValueError(
            f"need 0 <= c <= n and 1 <= k <= n, got n={num_samples}, c={num_correct}, k={k}"
        )
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - comb(num_samples - num_correct, k) / comb(num_samples, k)


def best_of_k(rewards: list[float], k: int) -> float:
    """Unbiased expected max reward over k of the samples (without replacement)."""
    n = len(rewards)
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    ordered = sorted(rewards)
    total = comb(n, k)
    # Each weight comb(i, k - 1) / total is at most 1: divided first (exactly, as integers are),
    # no product overflows a float however many samples there are.
    return sum(r * (comb(i, k - 1) / total) for i, r in enumerate(ordered))


@dataclasses.dataclass(frozen=True)
class EpisodeRecord:
    """One sampled episode of a task, as the evaluator sees it. `scores` are the grader's extra
    numbers (e.g. a state-tracking similarity); `group` a label reports break down by (e.g.
    "history_length=8")."""

    task_id: str
    reward: float
    tokens: int
    tool_calls: int
    flagged: bool = False
    turns: int = 0
    scores: dict = dataclasses.field(default_factory=dict)
    group: str = ""


HELDOUT_METRIC_ORDER = ("pass@1", "best_of", "turns", "tool_calls", "summaries", "feedback_turns")


def heldout_metric_order(name: str) -> tuple:
    """Sort key of a held-out metric's name (after the task reward, which callers put first):
    pass@1, best-of-K, the episode's shape, then the behaviour rewards by name."""
    fixed = HELDOUT_METRIC_ORDER
    rank = next((i for i, prefix in enumerate(fixed) if name.startswith(prefix)), len(fixed))
    return rank, name


def paired_by_task(first_ids, first, second_ids, second) -> tuple[np.ndarray, np.ndarray]:
    """Two per-task arrays on the tasks both hold, in the first's order: by task id where both
    records carry their ids (a held-out set can differ between two runs, or between two starts
    of one), else by position (records kept before the ids were), which needs equal lengths.
    ValueError when nothing pairs."""
    first, second = np.asarray(first, np.float64), np.asarray(second, np.float64)
    if len(first_ids) and len(second_ids):
        where = {task: i for i, task in enumerate(second_ids)}
        kept = [(i, where[task]) for i, task in enumerate(first_ids) if task in where]
        if not kept:
            raise ValueError("the two held-out records share no task: not paired")
        mine, theirs = (list(index) for index in zip(*kept))
        return first[mine], second[theirs]
    if len(first) != len(second):
        raise ValueError(
            f"held-out records of {len(first)} and {len(second)} tasks, without task ids: "
            "not paired"
        )
    return first, second


def mean_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of its two-sided `confidence` interval) by Student's t with n - 1
    degrees of freedom (tasks are few; the normal quantile would understate it). NaN width for
    fewer than two values."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    from scipy import stats

    variance = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * math.sqrt(variance / n)


def evaluate(
    records: list[EpisodeRecord], ks: tuple[int, ...] = (1, 5, 10), success_threshold: float = 1.0
) -> dict:
    """Aggregates episodes into pass@k, best-of-k, mean reward, tokens, turns and tool calls per
    task, then over tasks with 95% intervals (the task is the unit: its samples are not
    independent), overall and per group.

    A sample passes when its reward reaches `success_threshold`. A k larger than a task's sample
    count is skipped for that task; the report says over how many tasks each metric averages.
    """
    by_task: dict[str, list[EpisodeRecord]] = {}
    for record in records:
        by_task.setdefault(record.task_id, []).append(record)
    per_task = {}
    for task_id, samples in sorted(by_task.items()):
        rewards = [s.reward for s in samples]
        correct = sum(r >= success_threshold for r in rewards)
        entry = {
            "samples": len(samples),
            "group": samples[0].group,
            "mean_reward": sum(rewards) / len(rewards),
            "mean_tokens": sum(s.tokens for s in samples) / len(samples),
            "mean_turns": sum(s.turns for s in samples) / len(samples),
            "mean_tool_calls": sum(s.tool_calls for s in samples) / len(samples),
            "flagged": sum(s.flagged for s in samples),
        }
        for name in sorted({n for s in samples for n in s.scores}):
            values = [s.scores[name] for s in samples if name in s.scores]
            entry[f"mean_{name}"] = sum(values) / len(values)
        for k in ks:
            if k <= len(samples):
                entry[f"pass@{k}"] = pass_at_k(len(samples), correct, k)
                entry[f"best_of_{k}"] = best_of_k(rewards, k)
        per_task[task_id] = entry
    summary = {"tasks": len(per_task), "episodes": len(records), **_summarise(per_task, ks)}
    summary["flag_rate"] = sum(r.flagged for r in records) / max(1, len(records))
    groups = sorted({entry["group"] for entry in per_task.values()} - {""})
    by_group = {
        g: _summarise({t: e for t, e in per_task.items() if e["group"] == g}, ks) for g in groups
    }
    return {"summary": summary, "per_task": per_task, "by_group": by_group}


def _summarise(per_task: dict, ks: tuple[int, ...]) -> dict:
    """Means over tasks, each with its 95% half-width (`<key>_ci95`) and task count."""
    keys = ["mean_reward", "mean_tokens", "mean_turns", "mean_tool_calls"]
    keys += sorted({k for e in per_task.values() for k in e if k.startswith("mean_")} - set(keys))
    keys += [f"{m}{k}" for k in ks for m in ("pass@", "best_of_")]
    out = {}
    for key in keys:
        values = [entry[key] for entry in per_task.values() if key in entry]
        if values:
            out[key], out[f"{key}_ci95"] = mean_interval(values)
            out[f"{key}_tasks"] = len(values)
    return out


def format_table(report: dict) -> str:
    """The summary (and each group's) as a fixed-width table: mean +- 95% half-width."""

    def rows(summary: dict) -> list[tuple[str, str]]:
        out = []
        for key, value in summary.items():
            if key.endswith(("_tasks", "_ci95")):
                continue
            text = f"{value:.4f}" if isinstance(value, float) else str(value)
            if f"{key}_ci95" in summary and not math.isnan(summary[f"{key}_ci95"]):
                text += f" +- {summary[f'{key}_ci95']:.4f}"
            out.append((key, text))
        return out

    sections = [("", rows(report["summary"]))]
    sections += [(f"[{g}] ", rows(s)) for g, s in report.get("by_group", {}).items()]
    width = max(len(prefix + key) for prefix, section in sections for key, _ in section)
    lines = [f"{'metric'.ljust(width)}  value (95% CI over tasks)", f"{'-' * width}  -----"]
    for prefix, section in sections:
        lines += [f"{(prefix + key).ljust(width)}  {text}" for key, text in section]
    return "\n".join(lines)


def write_report(report: dict, path: str) -> None:
    """Writes the report as JSON, locally or in a bucket (epath)."""
    epath.Path(path).write_text(json.dumps(report, indent=2, sort_keys=True))
