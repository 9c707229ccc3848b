"""bench_main_job_sampler: its accounting of the loop's time (sums to the wall, charges each cost
where it belongs), and the benchmark end to end at toy sizes (slow): the tables and the ratio."""

from __future__ import annotations

import pytest

from experiments.bench_main_job_sampler import loop_accounting
from tests.experiments.bench_runner import run_bench


def test_the_accounting_sums_to_the_wall_and_charges_each_cost():
    summary = {
        "wall_s": 100.0,
        "busy": {"sampler": 0.9},
        "decoded_tokens": 60_000,
        "decode_steps_during_train": 2000,
        "decode_ms_during_train": 7.0,
        "decode_ms_alone": 3.0,
    }
    rows = dict(loop_accounting(summary, alone_rate=1000.0))
    assert sum(rows.values()) == pytest.approx(100.0)
    assert rows["its tokens at the engine's rate alone"] == pytest.approx(60.0)
    assert rows["decode calls slowed by a train step beside them"] == pytest.approx(8.0)
    assert rows["the other calls' difference from alone (- : faster)"] == pytest.approx(22.0)
    assert rows["sampler idle (nothing to decode)"] == pytest.approx(10.0)


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
        "Target: the loop >= 85% of alone.",
        "| decode calls slowed by a train step beside them |",
    ):
        assert line in stdout
