"""The GPU check: its plan, its runner (timeouts, crashes, budget) and a CPU dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experiments.gpu import gemm_cases, plan, report, runner, worker

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# One case of every kind, the GEMM ones covering each way a backend runs on CPU: XLA, Hopper
# kernels interpreted, Blackwell kernels lowered for cuda, quantization, the op end to end.
CI_CASES = [
    "probe",
    "tests/kernels",
    "gemm/dry_128x64_e4_t40/ragged_dot_bf16",
    "gemm/dry_128x64_e4_t40/hopper_bf16",
    "gemm/dry_128x64_e4_t40/hopper_bf16_persistent",
    "gemm/dry_128x64_e4_t40/hopper_bf16_ws",
    "gemm/dry_128x64_e4_t40/blackwell_nvfp4",
    "gemm/dry_128x64_e4_t40/blackwell_mxfp8_2cta",
    "gemm/dry_128x64_e4_t40/blackwell_wgrad_mxfp8",
    "gemm/dry_128x64_e4_t40/quantize_mxfp8",
    "collective/*",
    "train_check/bf16",
    "mfu/small/bf16",
    "decode/32",
    "batching/*",
]


def _env():
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device, as on the GPU machine
    return env


def test_dry_plan_has_every_case_kind_and_backend_of_the_real_plan():
    full, dry = plan.build(dry_run=False), plan.build(dry_run=True)
    kinds = {c["kind"] for c in full}
    assert kinds == {c["kind"] for c in dry} == set(worker.KINDS)
    strip = lambda c: c["name"].split("/")[0] + "/" + c["name"].split("/")[-1]  # noqa: E731
    assert {strip(c) for c in full if c["kind"] == "gemm"} == {
        strip(c) for c in dry if c["kind"] == "gemm"
    }
    for p in (full, dry):
        names = [c["name"] for c in p]
        assert len(names) == len(set(names))
        assert names[0] == "probe"
    assert {c["params"]["backend"] for c in dry if c["kind"] == "gemm"} == set(gemm_cases.BACKENDS)
    assert {c["params"]["shape"]["routing"] for c in dry if c["kind"] == "gemm"} == {
        "balanced",
        "skewed",
    }
    with pytest.raises(ValueError, match="no case matches"):
        plan.select(dry, ["nothing/*"])


def test_skewed_routing_has_empty_small_groups_and_a_tail():
    sizes, rows = gemm_cases.group_sizes(8, 1024, "skewed")
    assert sizes[0] == 0 and 0 < sizes[1] < 64 and sizes.sum() == 8 * 1024 < rows
    sizes, rows = gemm_cases.group_sizes(8, 1024, "balanced")
    assert (sizes == 1024).all() and rows == 8 * 1024


def test_runner_survives_hangs_crashes_and_errors(tmp_path):
    def case(name, kind, group, timeout_s=60, value=None):
        kind = f"tests.experiments.fake_cases:{kind}"
        return dict(name=name, kind=kind, group=group, timeout_s=timeout_s, params={"value": value})

    cases = [
        case("a/hang", "hang", "a", timeout_s=3),
        case("a/after_hang", "ok", "a", value=1),
        case("b/die", "die", "b"),
        case("b/after_die", "ok", "b", value=2),
        case("c/raises", "raises", "c"),
    ]
    seen = []
    results = runner.run_plan(
        cases, str(tmp_path), dry_run=True, budget_s=120, env=_env(), on_result=seen.append
    )
    status = {r["name"]: r["status"] for r in results}
    assert status == {
        "a/hang": "timeout",
        "a/after_hang": "ok",
        "b/die": "crash",
        "b/after_die": "ok",
        "c/raises": "fail",
    }
    assert [r["value"] for r in results if r["status"] == "ok"] == [1, 2]
    assert "broken on purpose" in results[-1]["error"]
    assert len(seen) == len(cases)


def test_runner_ignores_results_left_in_a_reused_out_folder(tmp_path):
    case = dict(name="x", kind="tests.experiments.fake_cases:ok", group="x", timeout_s=60,
                params={"value": 7})  # fmt: skip
    (tmp_path / "logs").mkdir()
    stale = {"event": "result", "name": "x", "status": "fail", "error": "from an older run"}
    (tmp_path / "logs" / "00-0.events").write_text(json.dumps(stale) + "\n")
    results = runner.run_plan([case], str(tmp_path), dry_run=True, budget_s=120, env=_env())
    assert [(r["status"], r.get("value")) for r in results] == [("ok", 7)]


def test_cases_past_the_budget_are_skipped(tmp_path):
    cases = [
        dict(name="x", kind="tests.experiments.fake_cases:ok", group="x", timeout_s=5, params={})
    ]
    results = runner.run_plan(cases, str(tmp_path), dry_run=True, budget_s=1, env=_env())
    assert results[0]["status"] == "skipped"


def test_report_renders_every_section():
    gemm = dict(kind="gemm", group="g", status="ok", mode="timed", ms=2.0, tflops=500.0)
    results = [
        dict(name="probe", kind="probe", group="p", status="ok", device_kind="NVIDIA H200"),
        dict(name="tests/kernels", kind="pytest", group="t", status="fail", tests=[("a", "failed")],
             failed=["a"], output_tail="E assert"),
        dict(name="gemm/s/ragged_dot_bf16", **gemm, format="bf16", peak_fraction=0.5),
        dict(name="gemm/s/hopper_bf16", **{**gemm, "ms": 1.0}, format="bf16", peak_fraction=1.0),
        dict(name="gemm/s/blackwell_nvfp4", kind="gemm", group="g", status="n/a", reason="no sm_100"),
        dict(name="mfu/small/bf16", kind="train_mfu", group="m", status="ok", step_ms=10.0,
             tokens_per_s=1e5, mfu=0.3, roofline_best_mfu=0.6, params=1e8),
        dict(name="decode/1024", kind="decode", group="d", status="timeout", reason="no result"),
    ]  # fmt: skip
    text = report.render(
        dict(started="now", elapsed_s=10.0, budget_s=480.0, dry_run=False, results=results)
    )
    for needle in ("## Checks", "## Grouped GEMM", "## Train step", "## Inference", "## Failures"):
        assert needle in text
    assert "| hopper_bf16 | timed | 1.000 | 500.0 | bf16 | 100.0 | 2.00 |" in text
    assert "n/a: no sm_100" in text and "30.0" in text and "timeout: no result" in text


# Slow tier (one process per case kind, each compiling its model): the runner's handling of
# hangs, crashes and errors stays in the default run.
@pytest.mark.slow
def test_dry_run_of_one_case_of_each_kind(tmp_path):
    """The CI dry run: every case kind through the real script, workers and report on CPU."""
    out = tmp_path / "check"
    cmd = [sys.executable, "experiments/gpu_check.py", "--dry_run", f"--out={out}"]
    proc = subprocess.run(
        cmd + ["--cases=" + ",".join(CI_CASES)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "report.json").read_text())
    kinds = {r["kind"] for r in data["results"]}
    assert kinds == set(worker.KINDS)
    bad = {r["name"]: r for r in data["results"] if r["status"] not in ("ok", "n/a")}
    assert not bad, json.dumps(bad, indent=1, default=str)[:3000]
    modes = {r["name"].split("/")[-1]: r.get("mode", "") for r in data["results"]}
    assert modes["blackwell_nvfp4"].startswith("lowered")
    assert modes["hopper_bf16"].startswith("timed (interpret")
    assert modes["hopper_bf16_persistent"].startswith("timed (interpret")
    assert modes["hopper_bf16_ws"].startswith("timed (interpret")
    assert modes["blackwell_mxfp8_2cta"].startswith("lowered")
    assert modes["blackwell_wgrad_mxfp8"].startswith("lowered")
    assert "## Grouped GEMM" in (out / "report.md").read_text()


@pytest.mark.slow
def test_full_dry_run(tmp_path):
    """Every case of the plan on CPU (about 6 minutes on 2 cores)."""
    out = tmp_path / "check"
    proc = subprocess.run(
        [
            sys.executable,
            "experiments/gpu_check.py",
            "--dry_run",
            f"--out={out}",
            "--budget_s=1200",
        ],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    data = json.loads((out / "report.json").read_text())
    assert len(data["results"]) == len(plan.build(dry_run=True))
    bad = [r["name"] for r in data["results"] if r["status"] not in ("ok", "n/a")]
    assert not bad, bad
