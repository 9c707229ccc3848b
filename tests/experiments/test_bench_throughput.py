"""bench_throughput's arithmetic, its rollout batch and trace window; the whole bench as a slow smoke run."""

from __future__ import annotations

import numpy as np
import pytest

from composer_jax import presets
from composer_jax.model import init_model
from experiments import bench_throughput
from tests.experiments.bench_runner import run_bench


def test_ideal_speedup():
    assert bench_throughput.ideal_speedup(1.0, 1.0) == pytest.approx(2.0)
    assert bench_throughput.ideal_speedup(3.0, 1.0) == pytest.approx(4.0 / 3.0)
    assert bench_throughput.ideal_speedup(1.0, 3.0) == pytest.approx(4.0 / 3.0)


def test_rollout_batch_trains_only_generated_tokens():
    model = init_model(presets.tiny().model, seed=0)
    batch = bench_throughput.rollout_batch(model, 4, 32, 2, prompt_len=8)
    assert batch.tokens_BT.shape == (4, 32)
    mask = np.asarray(batch.policy_mask_BT)
    assert not mask[:, :8].any() and mask[:, 8:].all()
    assert np.isfinite(np.asarray(batch.sampler_logprobs_BT)).all()


@pytest.mark.slow
def test_bench_runs_end_to_end(tmp_path):
    """The whole bench at toy sizes (about 3 minutes on 2 shared cores): every table and the ratios."""
    stdout = run_bench(
        "experiments.bench_throughput",
        "--steps=3",
        "--warm_start_steps=2",
        "--group_size=2",
        "--num_slots=4",
        "--max_new_tokens=8",
        "--context_len=384",
        "--prompt_len=100",
        "--train_steps=1",
        f"--out={tmp_path}",
    )
    for line in ("== 1. Train step", "== 2. Sampler", "== 3. Async vs sync", "Ratios: RL step"):
        assert line in stdout


def test_steady_summary_clips_the_trace_after_the_first_train_step():
    names = [
        {"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": name}}
        for tid, name in ((1, "sampler"), (2, "trainer"))
    ]
    spans = [
        {"ph": "X", "tid": 2, "cat": "train_step", "name": "s", "ts": 0.0, "dur": 1e6, "args": {}},
        {"ph": "X", "tid": 1, "cat": "decode", "name": "d", "ts": 5e5, "dur": 1.5e6, "args": {}},
    ]
    recorded = {"traceEvents": names + spans, "otherData": {"wall_s": 3.0}}
    steady = bench_throughput.steady_summary(recorded)
    assert steady["wall_s"] == pytest.approx(2.0)
    assert steady["busy"]["sampler"] == pytest.approx(0.5)  # 1 s of decode left in 2 s
    assert steady["busy"]["trainer"] == 0.0  # the first train step ends where the window starts
