"""Runs a list of GPU-check cases in one process, appending one JSON line per event.

  python -m experiments.gpu.worker SPEC.json EVENTS.jsonl

SPEC: {"dry_run": bool, "cases": [case, ...]}. Before a case: {"event": "start", "name"}; after:
{"event": "result", "name", "status", "seconds", "peak_bytes_in_use", ...}. The parent
(`runner`) enforces each case's timeout by watching these lines and restarts a fresh worker
after a hang or crash, so one bad case never takes the others with it.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback

KINDS = {
    "probe": "experiments.gpu.misc_cases:probe",
    "pytest": "experiments.gpu.misc_cases:pytest_gpu",
    "ragged_all_to_all": "experiments.gpu.misc_cases:ragged_all_to_all",
    "gemm": "experiments.gpu.gemm_cases:run",
    "train_check": "experiments.gpu.model_cases:train_check",
    "train_mfu": "experiments.gpu.model_cases:train_mfu",
    "decode": "experiments.gpu.model_cases:decode",
    "batching": "experiments.gpu.model_cases:batching",
}


def resolve(kind: str):
    """A case kind's function: a name above, or "package.module:function" (plug-ins, tests)."""
    target = KINDS.get(kind, kind)
    if ":" not in target:
        raise ValueError(f"unknown case kind {kind!r}; known: {sorted(KINDS)}")
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def main(spec_path: str, events_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    import jax

    ctx = {"dry_run": spec["dry_run"], "device_kind": jax.local_devices()[0].device_kind}
    with open(events_path, "a") as events:

        def emit(record):
            events.write(json.dumps(record, default=str) + "\n")
            events.flush()

        for case in spec["cases"]:
            emit({"event": "start", "name": case["name"]})
            start = time.perf_counter()
            try:
                result = resolve(case["kind"])(case.get("params", {}), ctx)
            except Exception as err:  # noqa: BLE001 -- a failing case is a result, not a stop
                result = {
                    "status": "fail",
                    "error": f"{type(err).__name__}: {err}"[:2000],
                    "traceback": traceback.format_exc()[-3000:],
                }
                if ctx["dry_run"]:
                    _reset_interpret_state()
            result["seconds"] = time.perf_counter() - start
            try:
                from experiments.gpu import timing

                result["peak_bytes_in_use"] = timing.peak_bytes_in_use()
            except Exception:  # noqa: BLE001 -- optional figure
                result["peak_bytes_in_use"] = None
            emit({"event": "result", "name": case["name"], **result})


def _reset_interpret_state() -> None:
    """GPU interpret mode needs a reset after an exception inside a kernel."""
    try:  # not exported publicly in JAX 0.12
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

        interpret_pallas_call.reset_gpu_interpret_mode_state()
    except Exception:  # noqa: BLE001 -- other versions: nothing to reset
        pass


if __name__ == "__main__":
    main(*sys.argv[1:3])
