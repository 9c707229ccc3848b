r"""How the ahead-of-time plan's compile grows with devices and layers, for the layers scanned (the
block compiled once, its costs counted per trip) and written out (every layer compiled).

Each case runs `launch.plan --steps=train --knobs=never` in its own process under a time limit
and records the compile seconds the plan prints, the process's wall time and its peak resident
memory (the child's high-water mark, read by a small wrapper per case), or how it failed (a
timeout, XLA's CPU compiler crashing). The model is `--config`'s with `num_layers` overridden
(the first `first_k_dense` layers stay dense) on `mesh_flags(devices)`. `--python` runs the
cases with another interpreter, e.g. a venv with the lent GPU image's JAX 0.11.2 (whose XLA:CPU
compiles the 1T step at 8 to 128 devices, where jaxlib 0.12's crashes).

  PYTHONPATH=. python experiments/bench_plan.py [--config=kimi_k2] [--devices=8,32,64,256]
      [--layers=2,4,8] [--limit_s=300] [--out=runs/bench_plan.json] [--python=VENV/bin/python]
"""

import itertools
import json
import re
import subprocess
import sys
import time

from absl import app, flags

FSDP_CAP = 64

# Runs a command and reports its peak resident memory: RUSAGE_CHILDREN covers only this
# wrapper's children, so each case gets its own high-water mark.
_WRAPPER = (
    "import resource, subprocess, sys\n"
    "code = subprocess.run(sys.argv[1:]).returncode\n"
    "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
    "print(f'PEAK_KIB {peak}', file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def mesh_flags(devices: int) -> list[str]:
    """A mesh for `devices` that every preset's phases and experts divide: fsdp up to 64 (the
    1T preset's long-context batch), context parallel beyond it, experts over fsdp."""
    fsdp = min(devices, FSDP_CAP)
    return [
        "--config.mesh.replica=1",
        f"--config.mesh.fsdp={fsdp}",
        f"--config.mesh.cp={devices // fsdp}",
        "--config.mesh.ep=fsdp",
    ]


def run_case(
    config: str, devices: int, layers: int, scan: bool, limit_s: int, python: str = sys.executable
) -> dict:
    """One plan in a fresh process of `python` (another JAX's interpreter, say); its compile
    seconds, wall time, peak memory and outcome."""
    command = [
        python,
        "-c",
        _WRAPPER,
        python,
        "-m",
        "launch.plan",
        f"--config={config}",
        f"--devices={devices}",
        "--steps=train",
        "--knobs=never",
        f"--config.model.num_layers={layers}",
        f"--config.model.scan_layers={scan}",
        *mesh_flags(devices),
    ]
    row = {"devices": devices, "layers": layers, "scan": scan}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {**row, "outcome": f"timeout ({limit_s} s)", "wall_s": limit_s}
    row["wall_s"] = round(time.perf_counter() - start, 1)
    peak = re.search(r"PEAK_KIB (\d+)", done.stderr)
    row["peak_rss_gib"] = round(int(peak[1]) / 2**20, 2) if peak else None
    compiled = re.search(r"compiled in ([\d.]+) s", done.stdout)
    mesh = re.search(r"devices \(([^)]*)\)", done.stdout)
    if done.returncode == 0 and compiled:
        row.update(outcome="ok", compile_s=float(compiled[1]), mesh=mesh[1] if mesh else "")
    else:
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        row["outcome"] = errors[0] if errors else f"exit {done.returncode}"
    return row


def _define_flags() -> None:
    """The command line's flags, defined only when this runs as a script: a test importing
    `run_case` must not register flags other experiments define too."""
    flags.DEFINE_string("config", "kimi_k2", "Preset whose training step is planned.")
    flags.DEFINE_list("devices", ["8", "32", "64", "256"], "Virtual device counts.")
    flags.DEFINE_list("layers", ["2", "4", "8"], "Layer counts (num_layers).")
    flags.DEFINE_list("scan", ["true", "false"], "Layers scanned, written out, or both.")
    flags.DEFINE_integer("limit_s", 300, "Time limit of one case, in seconds.")
    flags.DEFINE_string("out", "", "JSON file for the rows (default: print only).")
    flags.DEFINE_string(
        "python", sys.executable, "Interpreter of each case (with this checkout on its PYTHONPATH)."
    )


def main(argv):
    del argv
    f = flags.FLAGS
    rows = []
    cases = itertools.product(
        map(int, f.devices), map(int, f.layers), [s == "true" for s in f.scan]
    )
    for devices, layers, scan in cases:
        row = run_case(f.config, devices, layers, scan, f.limit_s, f.python)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if f.out:
            with open(f.out, "w") as out:
                json.dump({"config": f.config, "rows": rows}, out, indent=1)
    print("\n| devices | layers | layers compiled | compile s | wall s | peak RSS GiB | outcome |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | --- |")
    for r in rows:
        how = "scanned (one block)" if r["scan"] else "written out"
        print(
            f"| {r['devices']} | {r['layers']} | {how} | {r.get('compile_s', '-')} | "
            f"{r['wall_s']} | {r.get('peak_rss_gib', '-')} | {r['outcome']} |"
        )


if __name__ == "__main__":
    _define_flags()
    app.run(main)
