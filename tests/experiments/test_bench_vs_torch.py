"""The side-by-side benchmark against transformers runs end to end (golden extra; skipped without
it): logits checked equal, both ratios printed, both sides' op profiles."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_vs_torch_prints_both_ratios():
    done = subprocess.run(
        [sys.executable, "experiments/bench_vs_torch.py", "--repeats=1", "--seq_len=32",
         "--decode=3x5", "--batch=2", "--variants=dense_narrow", "--profile"],
        cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "logits equal within 0.0001" in done.stdout
    assert "ours / theirs: train step" in done.stdout and "decode 3x5" in done.stdout
    assert "| every layer dense, MLP 16 wide |" in done.stdout
    assert "slowest ops of forward + backward, ours" in done.stdout
    assert "aten::" in done.stdout  # the peer's profile
    assert "| backward | " in done.stdout.split("our matrix products by operation and pass")[1]
