"""pass@k and best-of-K from n samples per task, with the unbiased estimators, and a report.

pass@k = E[1 - C(n - c, k) / C(n, k)]: the chance that at least one of k samples drawn without
replacement from the n passes (Chen et al. 2021). best-of-K = the expected maximum reward of K
samples drawn without replacement: sum_i r_(i) C(i - 1, K - 1) / C(n, K) over rewards sorted
ascending (1-based i), which reduces to pass@k for 0/1 rewards. Plain Python: no JAX needed.
"""

import dataclasses
import json
from math import comb


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
    return sum(r * comb(i, k - 1) for i, r in enumerate(ordered)) / total


@dataclasses.dataclass(frozen=True)
class EpisodeRecord:
    """One sampled episode of a task, as the evaluator sees it."""

    task_id: str
    reward: float
    tokens: int
    tool_calls: int
    flagged: bool = False


def evaluate(
    records: list[EpisodeRecord], ks: tuple[int, ...] = (1, 5, 10), success_threshold: float = 1.0
) -> dict:
    """Aggregates episodes into pass@k, best-of-k, mean reward, tokens and tool calls per task.

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
            "mean_reward": sum(rewards) / len(rewards),
            "mean_tokens": sum(s.tokens for s in samples) / len(samples),
            "mean_tool_calls": sum(s.tool_calls for s in samples) / len(samples),
            "flagged": sum(s.flagged for s in samples),
        }
        for k in ks:
            if k <= len(samples):
                entry[f"pass@{k}"] = pass_at_k(len(samples), correct, k)
                entry[f"best_of_{k}"] = best_of_k(rewards, k)
        per_task[task_id] = entry
    summary = {"tasks": len(per_task), "episodes": len(records)}
    keys = ["mean_reward", "mean_tokens", "mean_tool_calls"]
    keys += [f"{m}{k}" for k in ks for m in ("pass@", "best_of_")]
    for key in keys:
        values = [entry[key] for entry in per_task.values() if key in entry]
        if values:
            summary[key] = sum(values) / len(values)
            summary[f"{key}_tasks"] = len(values)
    summary["flag_rate"] = sum(r.flagged for r in records) / max(1, len(records))
    return {"summary": summary, "per_task": per_task}


def format_table(report: dict) -> str:
    """A small fixed-width table of the summary."""
    rows = [(key, value) for key, value in report["summary"].items() if not key.endswith("_tasks")]
    width = max(len(key) for key, _ in rows)
    lines = [f"{'metric'.ljust(width)}  value", f"{'-' * width}  -----"]
    for key, value in rows:
        text = f"{value:.4f}" if isinstance(value, float) else str(value)
        lines.append(f"{key.ljust(width)}  {text}")
    return "\n".join(lines)


def write_report(report: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2, sort_keys=True)
