"""bench_main_job_sampler end to end at toy sizes (slow): both tables and the ratio line."""

from __future__ import annotations

import pytest

from tests.experiments.bench_runner import run_bench


@pytest.mark.slow
def test_bench_runs_end_to_end(tmp_path):
    stdout = run_bench(
        "experiments.bench_main_job_sampler",
        "--warm_start_steps=2",
        "--steps=2",
        "--groups=1",
        "--group_size=2",
        "--num_slots=4",
        "--max_new_tokens=8",
        "--noskip_uniform_groups",
        f"--out={tmp_path / 'bench'}",
    )
    for line in (
        "prompt sharing off:",
        "prompt sharing on :",
        "| in the loop, steps 2+ |",
        "Target: the loop >= 70% of alone.",
    ):
        assert line in stdout
