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


# The default tier's dry run: the cases whose imports reach the model, training and inference.
LENT_IMAGE_CASES = [
    "probe",
    "gemm/dry_128x64_e4_t40/ragged_dot_bf16",
    "train_check/bf16",
    "decode/32",
]
REPORT_FILES = {"report.json", "report.md"}


def _env(lent_image: bool = False):
    """One CPU device, as on the GPU machine; `lent_image`: only the packages that machine's
    image has can be imported (tests/experiments/lent_image/sitecustomize.py)."""
    path = (
        [os.path.join(REPO, "tests", "experiments", "lent_image"), REPO] if lent_image else [REPO]
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if lent_image:
        env["CJ_LENT_IMAGE"] = "1"
    return env


def _lent_image_dry_run(python: str, cases: list[str], out, timeout_s: int) -> dict:
    """The dry run of `cases` by `python` under the lent image's import guard: it succeeds, every
    case is ok or n/a, and `out` holds the report and at most four PNGs. Returns the report."""
    proc = subprocess.run(
        [python, "experiments/gpu_check.py", "--dry_run", f"--out={out}",
         "--cases=" + ",".join(cases)],
        cwd=REPO, env=_env(lent_image=True), capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "report.json").read_text())
    bad = {r["name"]: r for r in data["results"] if r["status"] not in ("ok", "n/a")}
    assert not bad, json.dumps(bad, indent=1, default=str)[:3000]
    extra = [p.name for p in out.iterdir() if p.name not in REPORT_FILES]
    assert all(name.endswith(".png") for name in extra) and len(extra) <= 4, extra
    return data


def test_a_dry_run_with_only_the_lent_images_packages_writes_only_the_report(tmp_path):
    """What the lent machine can run: none of the packages its image lacks is imported (they
    fail to import here), and the output folder holds the report and nothing else (a lent
    machine sends back only a few small files)."""
    data = _lent_image_dry_run(sys.executable, LENT_IMAGE_CASES, tmp_path / "check", 600)
    assert len(data["results"]) == len(LENT_IMAGE_CASES)


def test_the_lent_image_check_blocks_what_the_image_lacks():
    """The guard above has teeth: under it, the packages the image lacks do not import."""
    proc = subprocess.run(
        [sys.executable, "-c", "import grain"], env=_env(lent_image=True), capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and "not on the lent image" in proc.stderr


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


def test_every_planned_gemm_backend_is_built_and_an_unknown_one_is_refused():
    quantize_only = {b for b in gemm_cases.BACKENDS if b.startswith("quantize_")}
    assert set(gemm_cases.BACKENDS) - quantize_only == set(gemm_cases._BUILDERS)
    ctx = {"dry_run": True, "device_kind": "cpu"}
    with pytest.raises(ValueError, match="unknown GEMM backend 'hopper_fp16'"):
        gemm_cases.run({"shape": gemm_cases.DRY_SHAPES[0], "backend": "hopper_fp16"}, ctx)


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
    results = runner.run_plan(cases, dry_run=True, budget_s=120, env=_env(), on_result=seen.append)
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


def test_cases_past_the_budget_are_skipped(tmp_path):
    cases = [
        dict(name="x", kind="tests.experiments.fake_cases:ok", group="x", timeout_s=5, params={})
    ]
    results = runner.run_plan(cases, dry_run=True, budget_s=1, env=_env())
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
        env=_env(lent_image=True),
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


# What the lent image has (../shared/notes/device.md), at the JAX it has.
LENT_IMAGE_PACKAGES = [
    "jax[cpu]==0.11.2",
    "flax",
    "optax",
    "orbax-checkpoint",
    "chex",
    "absl-py",
    "etils[epath]",
    "tensorstore",
    "safetensors",
    "tokenizers",
    "tiktoken",
    "jinja2",
    "scipy",
    "matplotlib",
    "pyarrow",
    "pytest",
    "pytest-timeout",
    "pyyaml",
    "tqdm",
]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_dry_run_works_on_the_lent_images_jax(tmp_path):
    """A venv with JAX 0.11.2 and only the lent image's packages (pip resolves versions that
    work with that JAX) runs the dry run of one case of each kind: no import or API error."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    installed = subprocess.run(
        pip + LENT_IMAGE_PACKAGES, capture_output=True, text=True, timeout=1200
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    version = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import jax; print(jax.__version__)"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert version.stdout.strip() == "0.11.2", version.stdout + version.stderr
    _lent_image_dry_run(str(venv / "bin" / "python"), CI_CASES, tmp_path / "check", 900)
