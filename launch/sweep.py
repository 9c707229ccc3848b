r"""Sweeps: a grid of overrides and seeds, one run (and one workdir) each.

  python -m launch.sweep --sweep=experiments/sweeps/lr_seed_tiny.py --root=runs/lr_seed
  python -m launch.sweep --sweep=... --root=... --parallel=2 --compare [--compare_out=DIR]
  python -m launch.sweep --sweep=... --root=... --emit=slurm             # an array job instead
  python -m launch.sweep --sweep=... --root=... --dry_run                # the plan only

A sweep file's `get_sweep()` returns a dict:
  entry    "pretrain" (default) or "rl": the entry point (`launch.<entry>`) of every run
  base     a preset name, a config file ("FILE.py[:variant]", relative to the sweep file or the
           current folder), or a whole config as a dict / ExperimentConfig
  fixed    {field: value} overrides of every run
  product  {field: [values]}: every combination
  zip      {field: [values]} of equal lengths, taken together (one axis of the product)
  seeds    [seed, ...] (each run of the grid once per seed; default: the base's seed, or a
           `seed` field in fixed, product or zip, e.g. zipped with each seed's warm start)
  compare  optional keyword arguments of `composer_jax.eval.compare.compare_runs`
  slurm    optional {"time": "04:00:00", "gres": "gpu:1", ...} `#SBATCH` options
Fields are config paths as on the command line ("optim.learning_rate", "train.phases[0].seq_len").
Each run's workdir is `<root>/<name>`, its name made of the values that vary
("learning_rate=0.001,seed=1"); its output goes to `<root>/logs/<name>.log`. A run is finished
when its metrics reach the config's `steps` (and, for RL, its held-out "after" evaluation is
recorded); finished runs are skipped, interrupted ones resumed (the entry points resume a workdir),
and a failing run is reported without stopping the others.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from composer_jax import config as config_lib
from composer_jax import presets
from composer_jax.eval import compare
from composer_jax.eval.run_records import read_records

ENTRIES = ("pretrain", "rl")
SPEC_KEYS = {"entry", "base", "fixed", "product", "zip", "seeds", "compare", "slurm"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_FILE = "base_config.json"  # a dict base, in the sweep's root


class SweepError(ValueError):
    """A sweep file that cannot be planned; the message says what is wrong."""


@dataclasses.dataclass
class Run:
    name: str
    overrides: dict  # field path -> value, in command-line order (seed included)
    command: list[str]
    workdir: str
    log: str
    steps: int | None = None  # from the resolved config
    status: str = "new"  # new | started | finished


# ----------------------------------------------------------------------------- planning


def load_sweep_file(path: str) -> dict:
    """Imports the sweep file and returns its checked `get_sweep()`."""
    if not os.path.isfile(path):
        raise SweepError(f"--sweep={path}: no such file")
    spec_obj = importlib.util.spec_from_file_location("_sweep_file", path)
    module = importlib.util.module_from_spec(spec_obj)
    try:
        spec_obj.loader.exec_module(module)
        if not hasattr(module, "get_sweep"):
            raise SweepError(f"{path}: defines no get_sweep()")
        spec = module.get_sweep()
    except SweepError:
        raise
    except Exception as error:  # the sweep file's own bug: where it is, in one line
        raise SweepError(
            f"{path}{_line_in(path, error)}: {type(error).__name__}: {error}"
        ) from error
    return check_spec(spec, os.path.dirname(os.path.abspath(path)))


def _line_in(path: str, error: Exception) -> str:
    """ ":<line>" of the sweep file where `error` was raised (its innermost frame there)."""
    target = os.path.abspath(path)
    if (
        isinstance(error, SyntaxError)
        and error.filename
        and os.path.abspath(error.filename) == target
    ):
        return f":{error.lineno}"
    lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if f.filename == target]
    return f":{lines[-1]}" if lines else ""


def _check_compare(options) -> None:
    """The `compare` key's options are keyword arguments of `compare_runs` (checked before any
    run starts: a bad one would fail only once every run has finished)."""
    reserved = {"paths", "out_dir", "command"}  # the sweep gives these itself
    known = sorted(set(inspect.signature(compare.compare_runs).parameters) - reserved)
    if not isinstance(options, dict):
        raise SweepError(f"compare: expected a dict of options {known}, got {options!r}")
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise SweepError(f"compare: unknown options {unknown}; known: {known}")


def check_spec(spec: dict, folder: str = ".") -> dict:
    """Validates a sweep dict; a config-file base is made absolute (relative to `folder` if it is
    there, else to the current folder)."""
    if not isinstance(spec, dict):
        raise SweepError(f"get_sweep() must return a dict, got {type(spec).__name__}")
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise SweepError(f"unknown sweep keys {sorted(unknown)}; known: {sorted(SPEC_KEYS)}")
    spec = dict(spec)
    spec.setdefault("entry", "pretrain")
    if spec["entry"] not in ENTRIES:
        raise SweepError(f"entry: {spec['entry']!r} is not one of {ENTRIES}")
    base = spec.get("base")
    if base is None:
        raise SweepError("base: give a preset name, a config file or a config dict")
    if dataclasses.is_dataclass(base):
        spec["base"] = config_lib.to_dict(base)
    elif isinstance(base, str):
        if base not in presets.PRESETS:
            path, _, variant = base.partition(":")
            for candidate in (os.path.join(folder, path), path):
                if os.path.isfile(candidate):
                    spec["base"] = os.path.abspath(candidate) + (f":{variant}" if variant else "")
                    break
            else:
                raise SweepError(f"base: {base!r} is neither a preset nor a config file")
    elif not isinstance(base, dict):
        raise SweepError(f"base: expected a preset, a file or a dict, got {base!r}")
    for key in ("fixed", "product", "zip"):
        value = spec.setdefault(key, {})
        if not isinstance(value, dict):
            raise SweepError(f"{key}: expected a dict of field -> value(s)")
    for key in ("product", "zip"):
        for field, values in spec[key].items():
            if not isinstance(values, (list, tuple)) or not values:
                raise SweepError(f"{key}.{field}: expected a non-empty list of values")
    lengths = {len(v) for v in spec["zip"].values()}
    if len(lengths) > 1:
        raise SweepError(f"zip: the lists differ in length {sorted(lengths)}")
    _check_compare(spec.setdefault("compare", {}))
    seeds = spec.setdefault("seeds", [])
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise SweepError(f"seeds: expected a list of integers, got {seeds!r}")
    fields = [*spec["fixed"], *spec["product"], *spec["zip"]]
    # Without `seeds` a seed may vary like any field (zipped with its own warm start, say).
    owned = {"workdir", "seed"} if seeds else {"workdir"}
    twice = {f for f in fields if fields.count(f) > 1} | (owned & set(fields))
    if twice:
        raise SweepError(
            f"fields {sorted(twice)}: given twice (seed comes from `seeds` when it is given, "
            "workdir from --root)"
        )
    return spec


def grid(spec: dict) -> list[dict]:
    """The varying overrides of each run: product axes x the zipped axis x seeds."""
    axes = [[{field: v} for v in values] for field, values in spec["product"].items()]
    if spec["zip"]:
        fields, columns = list(spec["zip"]), list(zip(*spec["zip"].values()))
        axes.append([dict(zip(fields, column)) for column in columns])
    if spec["seeds"]:
        axes.append([{"seed": s} for s in spec["seeds"]])
    return [{k: v for part in combo for k, v in part.items()} for combo in itertools.product(*axes)]


def _value_text(value) -> str:
    """An override's value as the command line takes it back."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, dict)):
        return repr(value)
    return str(value)


def _name_part(field: str, value, short: bool) -> str:
    key = field.split(".")[-1] if short else field
    text = f"{value:g}" if isinstance(value, float) else _value_text(value)
    text = "".join(c if c.isalnum() or c in "._+-=" else "_" for c in text)
    return f"{key}={text}"


def run_names(varying: list[dict]) -> list[str]:
    """Names from the varying values: each field by its last path component unless two share it."""
    fields = list(dict.fromkeys(f for v in varying for f in v))
    lasts = [f.split(".")[-1] for f in fields]
    short = {f: lasts.count(f.split(".")[-1]) == 1 for f in fields}
    names = [",".join(_name_part(f, v[f], short[f]) for f in fields) or "run" for v in varying]
    if len(set(names)) != len(names):
        raise SweepError(f"two runs get the same name: {names}")
    return names


def _base_flag(spec: dict, root: str) -> str:
    base = spec["base"]
    return f"--config={os.path.join(root, BASE_FILE) if isinstance(base, dict) else base}"


def write_base(spec: dict, folder: str) -> str | None:
    """A dict base written as `<folder>/base_config.json`, the runs' `--config`; its path (None
    for a preset or file base, which the runs name directly)."""
    if not isinstance(spec["base"], dict):
        return None
    path = os.path.join(folder, BASE_FILE)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            json.dump(spec["base"], f, indent=1)
    except OSError as error:
        raise SweepError(f"cannot write the base config {path}: {error}") from error
    return path


def plan(spec: dict, root: str) -> list[Run]:
    """One Run per grid point with its command line (the entry point as a subprocess)."""
    root = os.path.abspath(root)
    varying = grid(spec)
    runs = []
    for name, values in zip(run_names(varying), varying):
        overrides = {**spec["fixed"], **values}
        workdir = os.path.join(root, name)
        command = [sys.executable, "-m", f"launch.{spec['entry']}", _base_flag(spec, root)]
        command += [f"--config.{k}={_value_text(v)}" for k, v in overrides.items()]
        command += [f"--config.workdir={workdir}", "--noprogress", "--log_every_s=60"]
        log = os.path.join(root, "logs", f"{name}.log")
        runs.append(Run(name, overrides, command, workdir, log))
    return runs


def subprocess_env() -> dict:
    """The runs import this checkout's packages, whatever the current folder."""
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, path) if p))


def resolve(run: Run, base_file: str | None = None) -> dict:
    """The run's config exactly as its entry point resolves it (`--print_config`); `base_file`:
    its dict base from there instead (before the sweep's root holds it)."""
    command = run.command
    if base_file:
        command = [f"--config={base_file}" if a.startswith("--config=") else a for a in command]
    result = subprocess.run(
        [*command, "--print_config"], capture_output=True, text=True, env=subprocess_env()
    )
    if result.returncode != 0:
        raise SweepError(f"{run.name}: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout)


def run_status(workdir: str, steps: int, entry: str) -> str:
    """finished: metrics reach `steps` (and for RL the held-out "after-<steps>" record exists);
    started: the workdir exists; new otherwise."""
    if not os.path.isdir(workdir):
        return "new"
    records = read_records(os.path.join(workdir, "metrics.jsonl"))
    done = max((r["step"] for r in records), default=-1) >= steps
    if entry == "rl":
        heldout = os.path.join(workdir, "heldout.json")
        try:
            with open(heldout) as f:
                done = done and f"after-{steps}" in json.load(f)
        except (OSError, ValueError):
            done = False
    return "finished" if done else "started"


def prepare(spec: dict, root: str) -> list[Run]:
    """The plan with every run's config resolved (a bad override fails here, before anything
    runs or is written) and its status."""
    runs = plan(spec, root)
    with tempfile.TemporaryDirectory() as folder:
        base_file = write_base(spec, folder)
        for run in runs:
            run.steps = resolve(run, base_file)["steps"]
            run.status = run_status(run.workdir, run.steps, spec["entry"])
    return runs


# ----------------------------------------------------------------------------- running


def execute(runs: list[Run], parallel: int = 1, out=None) -> dict[str, int]:
    """Runs the unfinished runs, `parallel` at a time, each writing to its log; prints a line per
    finished run. Returns {name: exit status} of the runs started."""
    out = out or sys.stdout
    todo = [r for r in runs if r.status != "finished"]
    for run in runs:
        if run.status == "finished":
            print(f"skip   {run.name} (finished: {run.steps} steps)", file=out, flush=True)
    running: list[tuple[Run, subprocess.Popen, float, object]] = []
    results: dict[str, int] = {}
    total = len(todo)
    try:
        while todo or running:
            while todo and len(running) < max(parallel, 1):
                running.append(_start(todo.pop(0), out))
            time.sleep(0.2)
            for item in list(running):
                run, proc, start, log = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                log.close()
                results[run.name] = proc.returncode
                seconds = time.perf_counter() - start
                if proc.returncode == 0:
                    line = f"done   {run.name} in {seconds:.0f} s"
                else:
                    line = (
                        f"FAILED {run.name} (exit {proc.returncode}, {seconds:.0f} s): "
                        f"{_last_line(run.log)}"
                    )
                print(f"[{len(results)}/{total}] {line}", file=out, flush=True)
    finally:  # stopped early: the runs save a checkpoint on SIGTERM and resume next time
        for _, proc, _, log in running:
            proc.terminate()
        for _, proc, _, log in running:
            proc.wait()
            log.close()
    return results


def _start(run: Run, out) -> tuple[Run, subprocess.Popen, float, object]:
    os.makedirs(os.path.dirname(run.log), exist_ok=True)
    log = open(run.log, "a")
    log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(run.command)}\n")
    log.flush()
    print(f"{'resume' if run.status == 'started' else 'start '} {run.name}", file=out, flush=True)
    proc = subprocess.Popen(run.command, stdout=log, stderr=subprocess.STDOUT, env=subprocess_env())
    return run, proc, time.perf_counter(), log


def _last_line(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return f"{lines[-1][:200]} (log: {path})" if lines else f"(empty log {path})"


def emit_slurm(spec: dict, runs: list[Run], root: str, parallel: int) -> str:
    """Writes `<root>/sweep.slurm`, an array job over the unfinished runs; returns its path."""
    todo = [r for r in runs if r.status != "finished"]
    if not todo:
        raise SweepError("every run is finished: nothing to emit")
    root = os.path.abspath(root)
    os.makedirs(os.path.join(root, "logs"), exist_ok=True)
    options = {"job-name": os.path.basename(root), "array": f"0-{len(todo) - 1}"}
    if parallel > 0:
        options["array"] += f"%{parallel}"
    options["output"] = os.path.join(root, "logs", "slurm-%A_%a.out")
    options.update(spec.get("slurm", {}))
    lines = ["#!/bin/bash"] + [f"#SBATCH --{k}={v}" for k, v in options.items()]
    lines += [
        f"# {len(todo)} unfinished runs of a {len(runs)}-run sweep (python -m launch.sweep; "
        "emit again to drop the finished ones). Each run resumes its workdir.",
        "set -euo pipefail",
        f"cd {shlex.quote(os.getcwd())}",
        f"export PYTHONPATH={shlex.quote(REPO)}${{PYTHONPATH:+:$PYTHONPATH}}",
        'case "$SLURM_ARRAY_TASK_ID" in',
    ]
    for i, run in enumerate(todo):
        lines.append(f"  {i}) exec {shlex.join(run.command)} >> {shlex.quote(run.log)} 2>&1 ;;")
    lines += ['  *) echo "no run $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;', "esac"]
    path = os.path.join(root, "sweep.slurm")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------- entry point


def _define_flags():
    from absl import flags

    return dict(
        sweep=flags.DEFINE_string(
            "sweep", None, "Sweep file (a get_sweep() function).", required=True
        ),
        root=flags.DEFINE_string("root", None, "Folder of the sweep's runs.", required=True),
        parallel=flags.DEFINE_integer(
            "parallel", 1, "Runs at once (array throttle for SLURM).", lower_bound=0
        ),
        emit=flags.DEFINE_enum("emit", None, ["slurm"], "Write a cluster job instead of running."),
        dry_run=flags.DEFINE_bool(
            "dry_run", False, "Print the plan (status and command) and stop."
        ),
        compare=flags.DEFINE_bool("compare", False, "Then compare the runs (launch.compare)."),
        compare_out=flags.DEFINE_string("compare_out", "", "Its folder (default <root>/compare)."),
    )


def main(flag_values: dict) -> int:
    try:
        spec = load_sweep_file(flag_values["sweep"].value)
        root = os.path.abspath(flag_values["root"].value)
        runs = prepare(spec, root)
        if flag_values["dry_run"].value:
            for run in runs:
                print(f"{run.status:8} {run.name}: {shlex.join(run.command)}")
            return 0
        write_base(spec, root)
        if flag_values["emit"].value == "slurm":
            path = emit_slurm(spec, runs, root, flag_values["parallel"].value)
            print(f"wrote {path}: sbatch {path}")
            return 0
        # A stopped sweep stops its runs (each saves a checkpoint and resumes next time).
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        results = execute(runs, flag_values["parallel"].value)
    except SweepError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    failed = sorted(name for name, code in results.items() if code != 0)
    finished = len(runs) - len(failed)
    print(
        f"{finished}/{len(runs)} runs finished, {len(results)} run now"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    if flag_values["compare"].value and not failed:
        report = compare.compare_runs(
            [r.workdir for r in runs],
            flag_values["compare_out"].value or os.path.join(root, "compare"),
            command="python -m launch.sweep " + shlex.join(sys.argv[1:]),
            **spec.get("compare", {}),
        )
        print(report.markdown)
    return 1 if failed else 0


if __name__ == "__main__":
    from launch import cli

    _FLAGS = _define_flags()
    cli.run(lambda argv: sys.exit(main(_FLAGS)))
