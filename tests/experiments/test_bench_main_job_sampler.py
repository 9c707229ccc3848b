"""bench_main_job_sampler end to end at toy sizes (slow): both tables and the ratio line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_bench_runs_end_to_end(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "experiments.bench_main_job_sampler",
        "--warm_start_steps=2",
        "--steps=2",
        "--groups=1",
        "--group_size=2",
        "--num_slots=4",
        "--max_new_tokens=8",
        "--noskip_uniform_groups",
        f"--out={tmp_path / 'bench'}",
    ]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, as the bench is run (not the tests' 8)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for line in (
        "prompt sharing off:",
        "prompt sharing on :",
        "| in the loop, steps 2+ |",
        "Target: the loop >= 70% of alone.",
    ):
        assert line in out.stdout
