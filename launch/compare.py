r"""Compare runs: final metrics (mean +- 95% Student-t interval over seeds), curves with seed
bands, paired per-task differences of held-out reward.

  python -m launch.compare runs/lr_seed                      # a sweep's root, or run folders
  python -m launch.compare runs/a runs/b --out=cmp --metrics=loss,eval_nll --curves=loss
  python -m launch.compare runs/ws --scatter=warm_start/loss,heldout_after --baseline=1
  python -m launch.compare runs/rl_from_each_seed --ignore=rl.warm_start   # one warm start a seed
  python -m launch.compare mlflow:http://tracking:5000#composer-jax   # runs an MLflow tracker logged
  python -m launch.compare --reports s0/before.json s0/after.json s1/before.json s1/after.json

With --reports the arguments are `launch.evaluate` reports in (before, after) pairs of the same
tasks, one pair a seed: every per-task metric's change, paired by task and pooled over the pairs.

Runs that differ only by seed form a group. Writes <out>/compare.md (printed too), curves.png and
with --scatter scatter.png (<out> defaults to <first folder>/compare, or ./compare for MLflow).
Library: composer_jax.eval.compare.
"""

import json
import os
import shlex
import sys

from absl import flags

from launch import cli

_OUT = flags.DEFINE_string("out", "", "Output folder (default: <first folder>/compare).")
_METRICS = flags.DEFINE_list("metrics", [], "Final metrics of the table (default: by run kind).")
_CURVES = flags.DEFINE_list("curves", [], "Metrics plotted against step (default: by run kind).")
_BASELINE = flags.DEFINE_integer("baseline", 0, "Group that paired differences are taken against.")
_SCATTER = flags.DEFINE_list("scatter", [], "x,y: final y against final x per run.")
_REPORTS = flags.DEFINE_bool(
    "reports", False, "The arguments are launch.evaluate reports, in (before, after) pairs."
)
_IGNORE = flags.DEFINE_list(
    "ignore", [], "Config fields that do not split groups (e.g. rl.warm_start, one per seed)."
)


def main(argv):
    from composer_jax.eval import compare

    folders = argv[1:]
    if _REPORTS.value:
        return _compare_reports(folders)
    if not folders:
        cli.fail("give run folders or sweep roots: python -m launch.compare DIR...")
    if _SCATTER.value and len(_SCATTER.value) != 2:
        cli.fail(f"--scatter: expected x,y, got {','.join(_SCATTER.value)}")
    first = folders[0]
    out = _OUT.value or (
        "compare" if first.startswith("mlflow:") else os.path.join(first, "compare")
    )
    try:
        report = compare.compare_runs(
            folders,
            out,
            metrics=_METRICS.value or None,
            curves=_CURVES.value or None,
            baseline=_BASELINE.value,
            scatter=tuple(_SCATTER.value) or None,
            command="python -m launch.compare " + shlex.join(sys.argv[1:]),
            ignore=tuple(_IGNORE.value),
        )
    except (FileNotFoundError, ValueError, IndexError) as error:
        cli.fail(str(error))
    except ImportError as error:
        cli.fail(f"mlflow: runs need the tracking extra (pip install -e .[tracking]): {error}")
    print(report.markdown)
    print(f"wrote {os.path.join(out, 'compare.md')}")


def _compare_reports(paths: list[str]) -> None:
    from composer_jax.eval import compare

    if not paths or len(paths) % 2:
        cli.fail(f"--reports: give report files in (before, after) pairs, got {len(paths)}")
    try:
        reports = [_read_report(path) for path in paths]
        text, _ = compare.evaluation_gains_table(list(zip(reports[::2], reports[1::2])))
    except ValueError as error:
        cli.fail(f"--reports: {error}")
    print(text)
    if _OUT.value:
        os.makedirs(_OUT.value, exist_ok=True)
        with open(os.path.join(_OUT.value, "compare.md"), "w") as f:
            f.write(f"`python -m launch.compare {shlex.join(sys.argv[1:])}`\n\n{text}\n")
        print(f"wrote {os.path.join(_OUT.value, 'compare.md')}")


def _read_report(path: str) -> dict:
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable report ({error})") from None
    per_task = report.get("per_task") if isinstance(report, dict) else None
    if not isinstance(per_task, dict) or not per_task:
        raise ValueError(f"{path}: not a launch.evaluate report (no per_task results)")
    if not all(isinstance(metrics, dict) for metrics in per_task.values()):
        raise ValueError(f"{path}: not a launch.evaluate report (a per_task entry is no record)")
    return report


if __name__ == "__main__":
    cli.run(main, positional=True)
