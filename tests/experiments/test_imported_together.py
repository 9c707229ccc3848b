"""The experiment scripts the tests import can share one process: xdist may put any two of their
test files in one worker, and two modules that define the same absl flag at import fail there."""

import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def imported_experiments() -> set[str]:
    """Every `experiments` module a test file imports."""
    names = set()
    for path in (REPO / "tests").rglob("*.py"):
        for line in path.read_text(encoding="utf-8").splitlines():
            found = re.match(r"from experiments import ([\w, ]+)$", line.strip())
            if found:
                names.update(n.strip() for n in found[1].split(","))
    return names


def test_the_imported_experiment_scripts_import_together():
    names = sorted(imported_experiments())
    assert {"bench_load", "bench_plan", "simulate_async"} <= set(names)
    done = subprocess.run(
        [sys.executable, "-c", f"from experiments import {', '.join(names)}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
