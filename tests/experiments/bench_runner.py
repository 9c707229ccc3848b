"""Runs an experiments/ bench as its users do: a module on one CPU device, in the repository."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(module: str, *args: str, timeout: float = 900) -> str:
    """The bench's stdout; fails with the end of its output when it exits non-zero."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, as the bench is run (not the tests' 8)
    out = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout
