"""The compile-time benchmark of the plan runs a case in its own process and reads it back."""

import os

from experiments import bench_plan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_case_reports_its_compile_time_and_memory(monkeypatch):
    monkeypatch.chdir(REPO)
    row = bench_plan.run_case("tiny", devices=4, layers=3, scan=True, limit_s=300)
    assert row["outcome"] == "ok", row
    assert 0 < row["compile_s"] < row["wall_s"]
    assert row["peak_rss_gib"] > 0.1  # a process that imported JAX and compiled
    assert row["mesh"] == "replica=1 x fsdp=4 x cp=1"


def test_a_case_past_its_limit_is_a_timeout(monkeypatch):
    monkeypatch.chdir(REPO)
    row = bench_plan.run_case("tiny", devices=8, layers=3, scan=True, limit_s=1)
    assert row["outcome"] == "timeout (1 s)"
