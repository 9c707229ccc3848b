"""What an RL run reports: held-out evaluations (computed once per key, kept in heldout.json),
per-step metrics of the trained groups, and the curves. Files go through `etils.epath`, so the
run's folder may be a bucket."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import time

import numpy as np
from etils import epath

from composer_jax.actor.evaluator import HeldoutResult
from composer_jax.actor.samples import trained_samples
from composer_jax.eval.passk import heldout_metric_order
from composer_jax.train.metrics import read_metrics

log = logging.getLogger(__name__)

# The trainer's per-part metrics (`rl.length_penalty.advantage_rms_metric`).
ADVANTAGE_RMS = "advantage_rms/"


def heldout_once(cfg, evaluator, model, path, key, progress) -> HeldoutResult:
    """The held-out evaluation under `key` ("before", "after-<step>"): read from `path` when a
    start of this run already made it, else computed and added there."""
    path = epath.Path(path)
    stored = json.loads(path.read_text()) if path.exists() else {}
    if key in stored:
        r = stored[key]
        metrics = {name: np.asarray(v) for name, v in r.get("metrics", {}).items()}
        ids = tuple(r.get("task_ids", ()))
        return HeldoutResult(np.asarray(r["per_task"]), r["pass_rate"], metrics, ids)
    start = time.perf_counter()
    result = evaluator.evaluate(model)
    log.info(
        f"Held-out reward ({cfg.rl.heldout.split} split) {key.split('-')[0]} RL: {result} "
        f"[{time.perf_counter() - start:.0f} s]"
    )
    stored[key] = {
        "per_task": result.per_task.tolist(),
        "task_ids": list(result.task_ids),
        "pass_rate": result.pass_rate,
        "metrics": {name: values.tolist() for name, values in result.metrics.items()},
    }
    path.write_text(json.dumps(stored))
    return result


def heldout_table(before: HeldoutResult, after: HeldoutResult) -> str:
    """Every held-out metric before and after RL with the paired difference and its 95%
    interval over tasks (the report's fig. 5 question: does best-of-K rise with pass@1?)."""
    names = ["reward", *sorted(set(before.metrics) & set(after.metrics), key=heldout_metric_order)]
    rows = ["| metric | before | after | change (95% CI, paired over tasks) |", "|---|---|---|---|"]
    for name in names:
        first = before.per_task if name == "reward" else before.metrics[name]
        last = after.per_task if name == "reward" else after.metrics[name]
        diff, half = after.improvement_over(before, "" if name == "reward" else name)
        rows.append(
            f"| {name} | {np.mean(first):.3f} | {np.mean(last):.3f} | {diff:+.3f} "
            f"({diff - half:+.3f} to {diff + half:+.3f}) |"
        )
    return "\n".join(rows)


def closing_summary(cfg, before: HeldoutResult, after: HeldoutResult, steps: int) -> str:
    """What the run changed, said plainly: the warm start's own numbers (and why its corpus NLL
    may rise), then the held-out reward before and after RL with the paired interval and
    whether it excludes zero."""
    lines = [f"Summary of {cfg.workdir}:"]
    warm = _warm_start_line(cfg)
    if warm:
        lines.append(warm)
    try:
        diff, half = after.improvement_over(before)
    except ValueError as error:  # an extended run's held-out set shares no task with its first
        lines.append(f"  RL, {steps} steps: held-out reward not compared ({error}).")
        return "\n".join(lines)
    low, high = diff - half, diff + half
    if low > 0:
        verdict = "RL raised it"
    elif high < 0:
        verdict = "RL lowered it"
    else:
        verdict = "no change that the 95% interval can tell from noise"
    lines.append(
        f"  RL, {steps} steps: held-out reward {before.mean:.3f} -> {after.mean:.3f}, "
        f"{diff:+.3f} (95% CI {low:+.3f} to {high:+.3f}, paired over {after.paired_tasks(before)} "
        f"tasks): {verdict}. Pass rate {before.pass_rate:.2f} -> {after.pass_rate:.2f}."
    )
    if before.metrics and after.metrics:
        lines.append(heldout_table(before, after))
    return "\n".join(lines)


def _warm_start_line(cfg) -> str:
    if cfg.rl.warm_start:
        return f"  warm start: the run in {cfg.rl.warm_start}"
    records = read_metrics(os.path.join(cfg.workdir, "warm_start", "metrics.jsonl"))
    losses = [r["loss"] for r in records if "loss" in r]
    nlls = [r["eval_nll"] for r in records if "eval_nll" in r]
    if not losses or len(nlls) < 2:
        return ""
    sft_only = all(p.data == "tasks" for p in cfg.train.phases)
    line = (
        f"  warm start: {cfg.rl.warm_start_steps} steps of "
        f"{'SFT on task solutions' if sft_only else 'training'}, training loss "
        f"{losses[0]:.3f} -> {losses[-1]:.3f}; held-out code-corpus NLL {nlls[0]:.2f} -> "
        f"{nlls[-1]:.2f} nats/token"
    )
    if sft_only and nlls[-1] > nlls[0]:
        line += " (it rises: SFT fits task solutions, not the corpus it is measured on)"
    return line


def group_metrics(groups, version: int, cfg) -> dict[str, float]:
    """The trained groups' rewards (over their measured samples: an abandoned one's 0 is no
    measurement, `trained_samples`), staleness, lengths and feedback."""
    rewards = np.concatenate([g.rewards[trained_samples(g)] for g in groups])
    lags = [version - g.min_version for g in groups]
    tokens = [
        int(sum(g.arrays["sequence_lengths"][g.arrays["sequence_sample"] == i]))
        for g in groups
        for i in range(len(g.rewards))
    ]
    summaries = [s for g in groups for s in g.metadata["summaries"]]
    feedback = [sum(f.values()) for g in groups for f in g.metadata["feedback"]]
    measured = {}
    if rewards.size:  # every sample of every group abandoned: no reward was measured
        measured = {"reward_mean": float(rewards.mean()), "pass_rate": float((rewards >= 1).mean())}
    return {
        **measured,
        "staleness_mean": float(np.mean(lags)),
        "staleness_max": float(np.max(lags)),
        "summaries_per_sample": float(np.mean(summaries)),
        "tokens_per_chain": float(np.mean(tokens)),
        "turns_per_sample": float(np.mean([g.arrays["num_turns"] for g in groups])),
        "tool_calls_per_sample": float(np.mean([g.arrays["num_tool_calls"] for g in groups])),
        "feedback_turns_per_sample": float(np.mean(feedback)),
    }


def plot_curves(metrics_path: str, out_path: str) -> None:
    """Reward, pass rate, KL, length penalty, staleness, sampling speed and each reward part's
    share of the advantage against the step, as one PNG (drawn in memory: matplotlib writes
    local files only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Step records (reward_mean is missing from a step whose every sample was abandoned).
    lines = [m for m in read_metrics(metrics_path) if "staleness_mean" in m]
    heldout = [m for m in read_metrics(metrics_path) if "heldout_reward" in m]
    if not lines:
        return
    steps = [m["step"] for m in lines]
    panels = (
        ("rollout_reward", "reward (all rollouts)"),
        ("pass_rate", "train pass rate"),
        ("kl_k1", "KL (k1) to reference"),
        ("length_penalty", "length penalty"),
        ("staleness_mean", "staleness (versions)"),
        ("tokens_per_second", "sampled tokens / s"),
    )
    fig, axes = plt.subplots(2, 4, figsize=(16, 6))
    _plot_advantage_parts(axes.flat[len(panels)], steps, lines)
    for ax, (key, title) in zip(axes.flat, panels):
        values = [m.get(key, np.nan) for m in lines]
        ax.plot(steps, values, lw=1.2)
        if key == "rollout_reward" and heldout:
            ax.scatter(
                [m["step"] for m in heldout],
                [m["heldout_reward"] for m in heldout],
                color="C3",
                zorder=3,
                label="held-out",
            )
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=100)
    plt.close(fig)
    epath.Path(out_path).write_bytes(image.getvalue())


def _plot_advantage_parts(ax, steps: list[int], lines: list[dict]) -> None:
    """One line per reward part (`advantage_rms/<part>`): which part the policy gradient follows."""
    parts = sorted({k for m in lines for k in m if k.startswith(ADVANTAGE_RMS)})
    for key in parts:
        label = key[len(ADVANTAGE_RMS) :]
        style = {"color": "k", "lw": 1.5} if label == "total" else {"lw": 1.0}
        ax.plot(steps, [m.get(key, np.nan) for m in lines], label=label, **style)
    if parts:
        ax.legend(fontsize=7)
    ax.set_title("advantage rms by reward part")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


@dataclasses.dataclass
class StepRates:
    """The loop's counters at the last step: `record` turns them into one step's metrics line."""

    time: float = dataclasses.field(default_factory=time.perf_counter)
    tokens: float = 0.0
    finished: float = 0.0
    reward_sum: float = 0.0

    def record(self, coordinator, ledger, trainer, groups, version, rl, metrics, extra) -> dict:
        """The trainer's metrics, the trained groups', the loop's counters and rates since the
        last step."""
        now = time.perf_counter()
        generated = coordinator.sampler_stats.get("generated_tokens", 0)
        snapshot = coordinator.snapshot()
        finished = snapshot["rollout_reward_samples"] - self.finished
        reward_sum = snapshot["rollout_reward_sum"] - self.reward_sum
        # Every measured sample of the groups finished since the last step, trained or not:
        # the policy's reward (reward_mean is over the trained groups only); none measured, none.
        rollout = {"rollout_reward": reward_sum / finished} if finished else {}
        record = {
            **metrics,
            **group_metrics(groups, version, rl),
            **snapshot,
            **rollout,
            **{f"ledger/{k}": v for k, v in ledger.stats().items()},
            **extra,
            "tokens_per_second": (generated - self.tokens) / max(now - self.time, 1e-9),
            "seconds_per_step": now - self.time,
        }
        self.time, self.tokens = now, generated
        self.finished = snapshot["rollout_reward_samples"]
        self.reward_sum = snapshot["rollout_reward_sum"]
        last = trainer.last_publish
        if last is not None and last.done() and not last.result().skipped:
            record["weight_sync_ratio"] = last.result().ratio
        return record
