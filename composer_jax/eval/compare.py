"""Comparing runs: final metrics over seeds, curves with seed bands, paired held-out differences.

A run is a folder or an MLflow run, read by `eval.run_records`. Runs whose configs differ only by
seed (and workdir) form a group; a group's final metric is the mean over its seeds with a 95%
Student-t interval (seeds are few). Paired differences of held-out reward pair the same task:
within a run (after RL - before RL), and between two groups, run by run of the same seed (the
held-out tasks are drawn from the seed). Plain numpy and matplotlib (Agg): no JAX.

Metric names: any key of metrics.jsonl (its last value in the run), `heldout_before`,
`heldout_after`, `heldout_gain` (after - before, per task, averaged), `heldout_pass_rate_after`,
and `<sub>/<key>` for a key of a sub-run's metrics (e.g. `warm_start/loss` of an RL run's SFT).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import numpy as np

from composer_jax.config import RLConfig, field_paths
from composer_jax.eval.passk import heldout_metric_order, mean_interval
from composer_jax.eval.run_records import RunRecord, read_runs

# The reading half, re-exported: a notebook or a script compares runs through this one module.
from composer_jax.eval.run_records import find_runs as find_runs
from composer_jax.eval.run_records import load_mlflow_runs as load_mlflow_runs
from composer_jax.eval.run_records import load_run as load_run
from composer_jax.eval.run_records import read_records as read_records

IGNORED_FIELDS = ("seed", "workdir")
PRETRAIN_METRICS = ("loss", "eval_nll")
RL_METRICS = ("heldout_before", "heldout_after", "heldout_gain", "rollout_reward", "kl_k1")
PRETRAIN_CURVES = ("loss", "eval_nll")
RL_CURVES = ("rollout_reward", "kl_k1")  # default curves: those of both that the runs have


@dataclasses.dataclass
class Group:
    label: str
    runs: list[RunRecord]

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.runs]


@dataclasses.dataclass
class Report:
    markdown: str
    rows: list[dict]  # per group: label, n, and (mean, half-width) per metric
    differences: list[dict]
    figures: list[str]


def group_runs(runs: list[RunRecord], ignore: tuple[str, ...] = ()) -> list[Group]:
    """Runs equal but for seed, workdir and the `ignore` fields (e.g. "rl.warm_start" when each
    seed has its own warm start) share a group, labelled by the fields that differ between
    groups (in the order the runs came)."""
    ignored = {_current_path(f) for f in (*IGNORED_FIELDS, *ignore)}
    keys, members = [], {}
    for run in runs:
        flat = {k: v for k, v in _config_paths(run).items() if k not in ignored}
        key = tuple(sorted(flat.items(), key=lambda kv: kv[0]))
        if key not in members:
            keys.append(key)
            members[key] = []
        members[key].append(run)
    dicts = [dict(k) for k in keys]
    fields = sorted({f for d in dicts for f in d if any(d.get(f) != o.get(f) for o in dicts)})
    lasts = [f.split(".")[-1] for f in fields]
    groups = []
    for key, flat in zip(keys, dicts):
        parts = []
        for field in fields:
            short = field.split(".")[-1] if lasts.count(field.split(".")[-1]) == 1 else field
            parts.append(f"{short}={_text(flat.get(field))}")
        label = ", ".join(parts) or "all runs"
        groups.append(Group(label, sorted(members[key], key=lambda r: r.seed)))
    return groups


def _config_paths(run: RunRecord) -> dict:
    """{field path: value} of the run's config, an older run's flat rl fields at their section
    paths, so runs from before and after rl's sections group and pair as the same setting."""
    return {_current_path(k): v for k, v in field_paths(run.config).items()}


def _current_path(path: str) -> str:
    """An old flat rl path at its section's ("rl.kl_coef" -> "rl.objective.kl_coef", from
    `RLConfig.MOVED`); any other path as it is."""
    moved = RLConfig.MOVED.get(path.removeprefix("rl.")) if path.startswith("rl.") else None
    return f"rl.{moved}" if moved else path


def _text(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# ----------------------------------------------------------------------------- metrics


def final_metric(run: RunRecord, name: str) -> float | None:
    """The run's final value of `name` (see the module docstring), None when it has none."""
    if name in ("heldout_before", "heldout_after"):
        values = run.per_task(name.split("_")[1])
        return None if values is None else float(values.mean())
    if name == "heldout_gain":
        try:
            pair = run.paired("before", run, "after")
        except ValueError:  # no task in common
            return None
        return None if pair is None else float((pair[1] - pair[0]).mean())
    if name == "heldout_pass_rate_after":
        key = run.after_key()
        return None if key is None else float(run.heldout[key]["pass_rate"])
    records = run.metrics
    if "/" in name:
        sub, name = name.split("/", 1)
        records = read_records(os.path.join(run.workdir, sub, "metrics.jsonl"))
    values = [r[name] for r in records if isinstance(r.get(name), (int, float))]
    return float(values[-1]) if values else None


def over_seeds(group: Group, name: str) -> tuple[float, float, int]:
    """(mean, 95% half-width, n) of the group's final values (NaN width for one seed)."""
    values = [v for v in (final_metric(r, name) for r in group.runs) if v is not None]
    if not values:
        return float("nan"), float("nan"), 0
    mean, half = mean_interval(values)
    return mean, half, len(values)


def default_metrics(runs: list[RunRecord]) -> list[str]:
    rl = any(r.heldout for r in runs)
    names = RL_METRICS if rl else PRETRAIN_METRICS
    return [n for n in names if any(final_metric(r, n) is not None for r in runs)]


def _cell(mean: float, half: float, n: int) -> str:
    """`mean +- half` with two significant digits of the half-width and the mean to match."""
    if n == 0:
        return "-"
    if n == 1 or math.isnan(half):
        return f"{mean:.4g} (n={n})"
    if half == 0:
        return f"{mean:.4g} +- 0"
    decimals = max(0, 1 - math.floor(math.log10(half)))
    return f"{mean:.{decimals}f} +- {half:.{decimals}f}"


def summary_table(groups: list[Group], metrics: list[str]) -> tuple[str, list[dict]]:
    """Markdown table: one row per group, final metrics as mean +- 95% interval over seeds."""
    header = "| group | seeds | " + " | ".join(metrics) + " |"
    lines = [header, "| --- | --- | " + " | ".join("---:" for _ in metrics) + " |"]
    rows = []
    for group in groups:
        row = {"label": group.label, "seeds": group.seeds}
        cells = []
        for name in metrics:
            mean, half, n = over_seeds(group, name)
            row[name] = (mean, half, n)
            cells.append(_cell(mean, half, n))
        rows.append(row)
        seeds = ",".join(str(s) for s in group.seeds)
        lines.append(f"| {group.label} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines), rows


# ----------------------------------------------------------------------------- paired differences


HELDOUT_FIELDS = re.compile(r"^(seed|data\.tasks|rl\.tasks|rl\.heldout\.\w+)$")


def _heldout_setting(run: RunRecord) -> dict:
    return {k: v for k, v in _config_paths(run).items() if HELDOUT_FIELDS.match(k)}


def paired_difference(baseline: Group, other: Group, which: str = "after") -> dict | None:
    """Per-task held-out reward of `other` minus `baseline`, pairing runs of the same seed and
    held-out settings on the tasks both held (by task id; by position without ids); pooled
    over (seed, task) pairs: mean, 95% half-width, pairs, seeds. The interval is over tasks,
    given these runs: run-to-run variance is the per-seed means' spread."""
    by_seed = {r.seed: r for r in baseline.runs}
    diffs, seeds = [], []
    for run in other.runs:
        base = by_seed.get(run.seed)
        if base is None:
            continue
        try:
            pair = base.paired(which, run, which)
        except ValueError as error:
            raise ValueError(f"{base.workdir} and {run.workdir}: {error}") from None
        if pair is None:
            continue
        # Ids name a task within its source and settings (builtin ids ignore max_ops): the
        # settings must agree too.
        if _heldout_setting(base) != _heldout_setting(run):
            raise ValueError(
                f"{base.workdir} and {run.workdir}: different held-out tasks; not paired"
            )
        a, b = pair
        diffs.append(b - a)
        seeds.append(run.seed)
    if not diffs:
        return None
    pooled = np.concatenate(diffs)
    mean, half = mean_interval(pooled.tolist())
    per_seed = [float(d.mean()) for d in diffs]
    return {
        "seed_half_width": mean_interval(per_seed)[1],  # run-to-run: NaN for one seed
        "baseline": baseline.label,
        "other": other.label,
        "which": which,
        "mean": mean,
        "half_width": half,
        "pairs": len(pooled),
        "seeds": seeds,
        "per_seed": per_seed,
    }


def paired_gain(label: str, metric: str, befores: list, afters: list) -> dict | None:
    """After - before of a metric per task, pooled over several (before, after) pairs of equal
    task lists (seeds), with each pair's mean change and the Student-t interval over them."""
    pairs = [
        (np.asarray(b, np.float64), np.asarray(a, np.float64))
        for b, a in zip(befores, afters)
        if len(b) == len(a)
    ]
    if not pairs:
        return None
    diffs = [a - b for b, a in pairs]
    pooled = np.concatenate(diffs)
    mean, half = mean_interval(pooled.tolist())
    per_seed = [float(d.mean()) for d in diffs]
    _, seed_half = mean_interval(per_seed)
    return {
        "group": label,
        "metric": metric,
        "before": float(np.concatenate([b for b, _ in pairs]).mean()),
        "mean": mean,
        "half_width": half,
        "pairs": len(pooled),
        "per_seed": per_seed,
        "seed_half_width": seed_half,
    }


def within_run_gain(group: Group, metric: str = "reward") -> dict | None:
    """After - before RL of a held-out metric per task, pooled over the group's runs (each run's
    own tasks), with each run's mean change and the Student-t interval over those seeds."""
    records = []
    for run in group.runs:
        try:
            pair = run.paired("before", run, "after", metric)
        except ValueError:  # an extended run's held-out set shares no task with its first
            continue
        if pair is not None:
            records.append(pair)
    return paired_gain(group.label, metric, *zip(*records)) if records else None


def gains_table(label: str, gains: list[dict]) -> str:
    """Markdown: each gain's metric before and after, the change paired by task and pooled, each
    seed's change and the interval over the seeds' own changes."""
    lines = [
        f"| {label}: metric | before | after | change, paired by task (95% CI) | "
        "change per seed | over seeds (95% CI) |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for g in gains:
        low, high = g["mean"] - g["half_width"], g["mean"] + g["half_width"]
        per_seed = ", ".join(f"{d:+.3f}" for d in g["per_seed"])
        spread = g["seed_half_width"]
        over_seeds = f"+- {spread:.3f}" if math.isfinite(spread) else "- (one seed)"
        lines.append(
            f"| {g['metric']} | {g['before']:.3f} | {g['before'] + g['mean']:.3f} | "
            f"{g['mean']:+.3f} ({low:+.3f} to {high:+.3f}, {g['pairs']} pairs) | {per_seed} | "
            f"{over_seeds} |"
        )
    return "\n".join(lines)


def heldout_gains_table(group: Group) -> tuple[str, list[dict]]:
    """Markdown: every held-out metric the group's runs recorded (reward, pass@1, best-of-K,
    turns, tool calls, summaries, feedback turns, behaviour rewards) before and after RL, the
    change paired by task and pooled over seeds, and the interval over the seeds' own changes
    (the report's fig. 5 question over several seeds)."""
    names = list(dict.fromkeys(m for run in group.runs for m in run.heldout_metrics()))
    gains = [g for g in (within_run_gain(group, m) for m in names) if g]
    return (gains_table(group.label, gains), gains) if gains else ("", [])


_NOT_METRICS = ("group", "samples", "flagged")


def evaluation_gains_table(pairs: list[tuple[dict, dict]]) -> tuple[str, list[dict]]:
    """`heldout_gains_table` for `launch.evaluate` reports: each (before, after) pair evaluated
    the same tasks (two checkpoints of one run, say), each pair a seed. Every per-task metric
    both reports of every pair hold."""
    columns = []
    for before, after in pairs:
        tasks = sorted(before["per_task"])
        if tasks != sorted(after["per_task"]):
            raise ValueError("a before and after report hold different tasks: not paired")
        columns.append((tasks, before["per_task"], after["per_task"]))
    shared = set.intersection(
        *(set(entry) for _, b, a in columns for entry in (*b.values(), *a.values()))
    )
    names = sorted(
        shared - set(_NOT_METRICS),
        key=lambda n: (n != "mean_reward", heldout_metric_order(n.removeprefix("mean_"))),
    )
    gains = []
    for name in names:
        befores = [[b[t][name] for t in tasks] for tasks, b, _ in columns]
        afters = [[a[t][name] for t in tasks] for tasks, _, a in columns]
        gains.append(paired_gain("reports", name, befores, afters))
    return gains_table("reports", gains), gains


def differences_table(groups: list[Group], baseline: int = 0) -> tuple[str, list[dict]]:
    """Markdown: each group's paired after-RL held-out difference against `groups[baseline]`,
    and each group's own after - before gain."""
    lines, rows = [], []
    gains = [g for g in (within_run_gain(g) for g in groups) if g]
    if gains:
        lines += [
            "| group | held-out after - before RL (paired by task) | task pairs |",
            "| --- | ---: | ---: |",
        ]
        lines += [
            f"| {g['group']} | {g['mean']:+.3f} +- {g['half_width']:.3f} | {g['pairs']} |"
            for g in gains
        ]
        rows += [{"kind": "gain", **g} for g in gains]
    if not 0 <= baseline < len(groups):  # -1 would pair the last group with itself
        raise ValueError(f"--baseline: {baseline} is not a group (0 to {len(groups) - 1})")
    base = groups[baseline]
    pairs = [paired_difference(base, g) for i, g in enumerate(groups) if i != baseline]
    pairs = [p for p in pairs if p]
    if pairs:
        lines += [
            "",
            f"| group - {base.label} | held-out after RL (paired by seed and task) | task pairs | "
            "per seed | over seeds (95% CI) |",
            "| --- | ---: | ---: | --- | ---: |",
        ]
        for p in pairs:
            per_seed = ", ".join(f"{s}: {d:+.3f}" for s, d in zip(p["seeds"], p["per_seed"]))
            spread = p["seed_half_width"]
            over_seeds = f"+- {spread:.3f}" if math.isfinite(spread) else "- (one seed)"
            lines.append(
                f"| {p['other']} | {p['mean']:+.3f} +- {p['half_width']:.3f} | {p['pairs']} | "
                f"{per_seed} | {over_seeds} |"
            )
        rows += [{"kind": "paired", **p} for p in pairs]
    return "\n".join(lines), rows


# ----------------------------------------------------------------------------- plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curve(run: RunRecord, name: str) -> tuple[np.ndarray, np.ndarray]:
    records = run.metrics
    if "/" in name:
        sub, name = name.split("/", 1)
        records = read_records(os.path.join(run.workdir, sub, "metrics.jsonl"))
    points = [(r["step"], r[name]) for r in records if isinstance(r.get(name), (int, float))]
    steps = np.asarray([p[0] for p in points], np.float64)
    return steps, np.asarray([p[1] for p in points], np.float64)


def draw_curves(groups: list[Group], metrics: list[str], axes=None):
    """One panel per metric (those some run has): each group's mean over seeds per step, the band
    from the lowest to the highest seed (steps logged by only some seeds use those). Returns the
    figure, or None when no run has any of the metrics."""
    metrics = [m for m in metrics if any(len(curve(r, m)[0]) for g in groups for r in g.runs)]
    if not metrics:
        return None
    if axes is None:
        plt = _pyplot()
        _, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.8), squeeze=False)
        axes = axes[0]
    for ax, name in zip(axes, metrics):
        for group in groups:
            values: dict[float, list[float]] = {}
            for run in group.runs:
                for step, value in zip(*curve(run, name)):
                    values.setdefault(step, []).append(value)
            if not values:
                continue
            steps = np.asarray(sorted(values))
            stacked = [np.asarray(values[s]) for s in steps]
            mean = np.asarray([v.mean() for v in stacked])
            (line,) = ax.plot(steps, mean, label=f"{group.label} (n={len(group.runs)})")
            low = np.asarray([v.min() for v in stacked])
            high = np.asarray([v.max() for v in stacked])
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set(xlabel="step", title=name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig = axes[0].figure
    fig.suptitle("mean over seeds; band: lowest to highest seed", fontsize=9)
    fig.tight_layout()
    return fig


def plot_curves(groups: list[Group], metrics: list[str], path: str) -> str | None:
    """`draw_curves` saved as a PNG at `path` (None when there is nothing to draw)."""
    fig = draw_curves(groups, metrics)
    if fig is None:
        return None
    return _save(fig, path)


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def correlation(xs: list[float], ys: list[float]) -> dict:
    """Pearson r with its 95% interval (Fisher z) and Spearman's rank correlation."""
    from scipy import stats

    n = len(xs)
    if n < 3 or np.ptp(xs) == 0 or np.ptp(ys) == 0:  # std of equal floats can be 1e-17, not 0
        return {"n": n}  # undefined
    r = float(np.corrcoef(xs, ys)[0, 1])
    half = 1.959964 / math.sqrt(n - 3) if n > 3 else float("inf")
    z = math.atanh(max(min(r, 0.999999), -0.999999))
    return {
        "n": n,
        "pearson": r,
        "pearson_ci95": (math.tanh(z - half), math.tanh(z + half)),
        "spearman": float(stats.spearmanr(xs, ys).statistic),
    }


def draw_scatter(groups: list[Group], x: str, y: str, ax=None) -> dict:
    """Each run's final `y` against its final `x`, coloured by group; returns the correlation
    over runs (and the axes, under "ax")."""
    if ax is None:
        _, ax = _pyplot().subplots(figsize=(5.5, 4.2))
    xs, ys = [], []
    for group in groups:
        points = [(final_metric(r, x), final_metric(r, y)) for r in group.runs]
        points = [p for p in points if None not in p]
        if points:
            ax.scatter(*zip(*points), label=group.label, s=24)
            xs += [p[0] for p in points]
            ys += [p[1] for p in points]
    stats = correlation(xs, ys)
    title = f"{y} vs {x}"
    if "pearson" in stats:
        title += (
            f"\nPearson r={stats['pearson']:.2f}, Spearman {stats['spearman']:.2f}, n={stats['n']}"
        )
    ax.set(xlabel=x, ylabel=y, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.figure.tight_layout()
    return {**stats, "ax": ax}


def plot_scatter(groups: list[Group], x: str, y: str, path: str) -> dict:
    """`draw_scatter` saved as a PNG at `path`; returns the correlation."""
    stats = draw_scatter(groups, x, y)
    _save(stats.pop("ax").figure, path)
    return stats


# ----------------------------------------------------------------------------- all together


def compare_runs(
    paths: list[str],
    out_dir: str | None = None,
    metrics: list[str] | None = None,
    curves: list[str] | None = None,
    baseline: int = 0,
    scatter: tuple[str, str] | None = None,
    command: str | None = None,
    ignore: tuple[str, ...] = (),
) -> Report:
    """Reads the runs under `paths`, groups them by seed (and the `ignore` fields), and writes
    `compare.md`, `curves.png` (and `scatter.png`) to `out_dir` (nothing written when it is
    None)."""
    runs = read_runs(paths)
    groups = group_runs(runs, ignore)
    metrics = list(metrics) if metrics else default_metrics(runs)
    table, rows = summary_table(groups, metrics)
    diff_text, differences = differences_table(groups, baseline)
    made_by = command or "python -m launch.compare " + " ".join(paths)
    parts = [
        f"Made by `{made_by}`: {len(runs)} runs in {len(groups)} groups; final values, mean +- "
        "95% Student-t interval over seeds.",
        "",
        table,
    ]
    if diff_text:
        parts += ["", diff_text]
    for group in groups:
        gains_text, gains = heldout_gains_table(group)
        if len(gains) > 1:  # more than the reward, which the table above already has
            parts += ["", gains_text]
    figures = []
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        names = list(curves) if curves else list(dict.fromkeys(RL_CURVES + PRETRAIN_CURVES))
        path = plot_curves(groups, names, os.path.join(out_dir, "curves.png"))
        if path:
            figures.append(path)
        if scatter:
            stats = plot_scatter(groups, *scatter, os.path.join(out_dir, "scatter.png"))
            figures.append(os.path.join(out_dir, "scatter.png"))
            if "pearson" in stats:
                low, high = stats["pearson_ci95"]
                parts += [
                    "",
                    f"{scatter[1]} against {scatter[0]} over {stats['n']} runs: Pearson r = "
                    f"{stats['pearson']:.2f} (95% interval {low:.2f} to {high:.2f}), Spearman "
                    f"{stats['spearman']:.2f}.",
                ]
        parts += ["", "Figures: " + ", ".join(f"`{f}`" for f in figures)] if figures else []
    markdown = "\n".join(parts) + "\n"
    if out_dir is not None:
        with open(os.path.join(out_dir, "compare.md"), "w") as f:
            f.write(markdown)
    return Report(markdown, rows, differences, figures)
