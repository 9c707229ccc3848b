r"""The prepared GPU check: one command, at most `--budget_s` (8 minutes), a JSON and a markdown
report in `--out`.

Runs, in priority order, each case in a worker process under its own timeout (experiments/gpu/):
the GPU-marked kernel tests compiled on the device; grouped-GEMM TFLOP/s at DeepSeek-V3 / Kimi-K2
expert shapes (balanced, skewed, empty and small groups) for lax.ragged_dot bf16, JAX's own Mosaic
GPU ragged_dot, this project's Hopper bf16 / MXFP8 / NVFP4 kernels and wgrad kernel (Blackwell
kernels on a B200), each checked against a float32 reference before it is timed on the device
clock, quantization timed on its own and end to end; ragged all-to-all; the train step with each
expert precision; train-step MFU of `small` and of a wider config (bf16 and NVFP4/MXFP8 experts)
with the roofline's best MFU beside it; cached decode at 1k and 8k context and continuous
batching at 64 slots; peak memory of each. Nothing is downloaded; a missing feature is reported
"n/a: why". `--dry_run` runs the same plan on CPU with tiny shapes (Hopper kernels in interpret
mode, Blackwell and JAX's kernel lowered for cuda).

  python experiments/gpu_check.py --out=experiments/gpu/$(date +%F)-h200
  python experiments/gpu_check.py --dry_run --out=/tmp/gpu_check_dry [--cases='gemm/*,probe']
  python experiments/gpu_check.py --list [--dry_run]
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

from absl import app, flags

_OUT = flags.DEFINE_string("out", None, "Folder for report.json and report.md.")
_DRY = flags.DEFINE_bool("dry_run", False, "Tiny shapes on CPU (interpret / lowering mode).")
_BUDGET = flags.DEFINE_float("budget_s", 480.0, "Wall-clock budget for the whole plan.")
_CASES = flags.DEFINE_list("cases", [], "Shell patterns of case names to run (default: all).")
_LIST = flags.DEFINE_bool("list", False, "Print the plan and exit.")


def _env(dry_run: bool) -> dict:
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.pop("JAX_PLATFORMS", None)
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # peak memory per case is real
    return env


def main(argv):
    del argv
    from experiments.gpu import plan, report, runner

    cases = plan.select(plan.build(_DRY.value), _CASES.value)
    if _LIST.value:
        for c in cases:
            print(f"{c['timeout_s']:>5.0f}s  {c['group']:<40} {c['name']}")
        return
    if not _OUT.value:
        raise app.UsageError("--out=DIR is required")
    os.makedirs(_OUT.value, exist_ok=True)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    t0 = time.monotonic()

    def progress(result):
        extra = result.get("reason") or result.get("error") or ""
        print(
            f"[{time.monotonic() - t0:6.1f}s] {result['status']:<8} {result['name']} {extra}"[:200]
        )
        sys.stdout.flush()

    results = runner.run_plan(
        cases,
        dry_run=_DRY.value,
        budget_s=_BUDGET.value,
        env=_env(_DRY.value),
        on_result=progress,
    )
    data = {
        "started": started,
        "elapsed_s": time.monotonic() - t0,
        "budget_s": _BUDGET.value,
        "dry_run": _DRY.value,
        "plan": [c["name"] for c in cases],
        "results": results,
    }
    with open(os.path.join(_OUT.value, "report.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    with open(os.path.join(_OUT.value, "report.md"), "w") as f:
        f.write(report.render(data))
    print(f"wrote {_OUT.value}/report.json and report.md")


if __name__ == "__main__":
    app.run(main)
