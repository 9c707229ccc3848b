r"""Compare runs: final metrics (mean +- 95% Student-t interval over seeds), curves with seed
bands, paired per-task differences of held-out reward.

  python -m launch.compare runs/lr_seed                      # a sweep's root, or run folders
  python -m launch.compare runs/a runs/b --out=cmp --metrics=loss,eval_nll --curves=loss
  python -m launch.compare runs/ws --scatter=warm_start/loss,heldout_after --baseline=1
  python -m launch.compare runs/rl_from_each_seed --ignore=rl.warm_start   # one warm start a seed
  python -m launch.compare mlflow:http://tracking:5000#composer-jax   # runs an MLflow tracker logged

Runs that differ only by seed form a group. Writes <out>/compare.md (printed too), curves.png and
with --scatter scatter.png (<out> defaults to <first folder>/compare, or ./compare for MLflow).
Library: composer_jax.eval.compare.
"""

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
_IGNORE = flags.DEFINE_list(
    "ignore", [], "Config fields that do not split groups (e.g. rl.warm_start, one per seed)."
)


def main(argv):
    from composer_jax.eval import compare

    folders = argv[1:]
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


if __name__ == "__main__":
    cli.run(main, positional=True)
