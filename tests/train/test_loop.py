"""The pretraining loop end to end: resumption after a kill, non-finite stops, bad checkpoints."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import interop
from composer_jax.config import ConfigError
from composer_jax.model import init_model
from composer_jax.train import (
    CheckpointError,
    NonFiniteLossError,
    loop,
    read_metrics,
    run_pretraining,
)
from composer_jax.train.workdir import write_config
from tests.train.helpers import ONE_PHASE, make_corpus, tiny_experiment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("corpus")))


def _losses(workdir):
    return {
        m["step"]: m["loss"]
        for m in read_metrics(os.path.join(workdir, "metrics.jsonl"))
        if "loss" in m
    }


def _config_file(path, workdir, corpus, steps):
    path.write_text(
        textwrap.dedent(f"""
        import ml_collections
        from composer_jax import config
        from tests.train.helpers import tiny_experiment

        def get_config():
            cfg = tiny_experiment({str(workdir)!r}, {corpus!r}, steps={steps})
            return ml_collections.ConfigDict(config.to_dict(cfg))
    """)
    )
    return str(path)


# SIGKILL in the slow tier; SIGTERM (a clean stop, then the same resume) in the default run.
@pytest.mark.parametrize(
    "sig", [pytest.param(signal.SIGKILL, marks=pytest.mark.slow), signal.SIGTERM]
)
def test_killed_run_resumes_with_identical_losses(tmp_path, corpus, sig):
    """SIGKILL: resume from the last periodic save. SIGTERM: the run saves where it stops."""
    steps = 10
    reference = run_pretraining(tiny_experiment(str(tmp_path / "ref"), corpus, steps), False)
    assert reference.eval_nll_end < reference.eval_nll_start
    want = _losses(tmp_path / "ref")
    assert sorted(want) == list(range(1, steps + 1))

    workdir = tmp_path / "killed"
    cmd = [
        sys.executable,
        "-m",
        "launch.pretrain",
        "--noprogress",
        "--config=" + _config_file(tmp_path / "cfg.py", workdir, corpus, steps),
    ]
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    checkpoints = workdir / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if checkpoints.exists() and any(d.isdigit() for d in os.listdir(checkpoints)):
            break  # A finalised checkpoint exists; the run is somewhere after it.
        time.sleep(0.02)
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
    proc.send_signal(sig)
    returncode = proc.wait()
    killed_at = max(_losses(workdir))
    assert killed_at < steps
    if sig == signal.SIGTERM:
        assert returncode == 128 + signal.SIGTERM
        saved = [int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit()]
        assert max(saved) == killed_at

    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Resumed from" in done.stdout
    got = _losses(workdir)
    assert sorted(got) == list(range(1, steps + 1))
    assert got == want  # Bit-identical: same data position, same state.


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, corpus, monkeypatch):
    real_step = loop.train_step

    def poisoned_step(*args, **kwargs):
        state, metrics = real_step(*args, **kwargs)
        metrics["loss"] = jnp.where(state.step >= 5, jnp.nan, metrics["loss"])
        return state, metrics

    monkeypatch.setattr(loop, "train_step", poisoned_step)
    cfg = tiny_experiment(str(tmp_path / "nan"), corpus, steps=10)
    with pytest.raises(NonFiniteLossError, match=r"at step 5.*checkpoints/3"):
        run_pretraining(cfg, progress=False)
    saved = sorted(int(d) for d in os.listdir(tmp_path / "nan" / "checkpoints") if d.isdigit())
    assert saved == [3]


def test_init_from_pretrained_checkpoint(tmp_path, corpus):
    """A fresh run takes every weight of an HF-format checkpoint; MTP heads stay fresh."""
    cfg = tiny_experiment(str(tmp_path / "run"), corpus, steps=2)
    pretrained = init_model(dataclasses.replace(cfg.model, num_mtp_layers=0), seed=11)
    interop.export_hf_checkpoint(pretrained, tmp_path / "hf")
    cfg = dataclasses.replace(cfg, init_from=str(tmp_path / "hf"))
    setup = loop.make_train_setup(cfg)
    placed = interop.load_pretrained(cfg, setup.layout)  # as a run loads it: already sharded
    shardings = nnx.to_pure_dict(setup.shardings.params)
    embed = nnx.to_pure_dict(nnx.state(placed))["embed"]
    assert embed.sharding == shardings["embed"] and len(embed.sharding.device_set) == 8
    state = loop.initial_state(setup, placed)
    fresh = loop.make_train_setup(dataclasses.replace(cfg, init_from="")).init_state()
    want = nnx.to_pure_dict(nnx.state(pretrained))
    got = nnx.to_pure_dict(state.params)
    np.testing.assert_array_equal(got["embed"], want["embed"])
    np.testing.assert_array_equal(
        got["moe_layers"]["mlp"]["gate"], want["moe_layers"]["mlp"]["gate"]
    )
    np.testing.assert_array_equal(
        got["mtp"][0]["proj"], nnx.to_pure_dict(fresh.params)["mtp"][0]["proj"]
    )
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_heads=4))
    with pytest.raises(ConfigError, match="model.num_heads"):
        interop.load_pretrained(other)
    with pytest.raises(ConfigError, match="init_from: pass pretrained"):
        loop.run_pretraining(dataclasses.replace(cfg, workdir=str(tmp_path / "b")), False)


def test_mismatched_checkpoint_is_reported(tmp_path, corpus):
    """A checkpoint that does not fit the config is named even when the stored config was edited
    to match the new one by hand (the config diff cannot see it)."""
    cfg = tiny_experiment(str(tmp_path / "run"), corpus, steps=3, phases=ONE_PHASE)
    run_pretraining(cfg, progress=False)
    wider = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, kv_lora_rank=8))
    write_config(cfg.workdir, wider)
    with pytest.raises(CheckpointError, match="kv_a"):
        run_pretraining(wider, progress=False)


def test_a_run_with_qk_clip_logs_its_logits_and_the_heads_it_clipped(tmp_path, corpus):
    """`--config.optim.qk_clip_threshold` reaches the run's step: each logged step has the
    largest attention logit and, with the threshold below it, the heads QK-clip rescaled."""
    cfg = tiny_experiment(str(tmp_path / "clip"), corpus, steps=2)
    one_phase = (dataclasses.replace(cfg.train.phases[0], fraction=1.0),)
    cfg = dataclasses.replace(
        cfg,
        optim=dataclasses.replace(cfg.optim, qk_clip_threshold=0.5),
        train=dataclasses.replace(cfg.train, phases=one_phase),
    )
    run_pretraining(cfg, progress=False)
    records = [m for m in read_metrics(os.path.join(cfg.workdir, "metrics.jsonl")) if "loss" in m]
    assert [m["step"] for m in records] == [1, 2]
    for m in records:
        assert m["attention_max_logit"] > 0.5 and m["qk_clipped_heads"] > 0


@pytest.mark.slow  # default twins: tests/optim/test_sharded_muon.py, the resume tests above
def test_muon_run_trains_and_resumes(tmp_path, corpus):
    """`--config.optim.name=muon` trains on the sharded layout, and its sharded optimizer state
    survives a checkpoint round trip."""
    cfg = tiny_experiment(str(tmp_path / "muon"), corpus, steps=3)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name="muon"))
    first = run_pretraining(cfg, progress=False)
    assert first.final_step == 3 and first.eval_nll_end < first.eval_nll_start
    resumed = run_pretraining(dataclasses.replace(cfg, steps=4, resume="must"), progress=False)
    assert resumed.final_step == 4
    assert sorted(_losses(tmp_path / "muon")) == [1, 2, 3, 4]


def _two_process_exchange(monkeypatch, answers):
    """`StopRequest.agreed` as on 2 processes, the exchange answering from `answers` (a function
    of this process's value and the call number); returns the values this process sent."""
    sent = []

    def allgather(mine):
        sent.append(int(mine))
        return np.asarray(answers(int(mine), len(sent)), np.int32)

    monkeypatch.setattr(loop.jax, "process_count", lambda: 2)
    monkeypatch.setattr(loop.multihost_utils, "process_allgather", allgather)
    return sent


def test_a_signal_during_the_stop_exchange_counts_at_the_next_boundary(monkeypatch):
    """A signal handler runs as the exchange returns, after every process sent "no signal": the
    others go on to the next step, so this process must too (stopping alone, it would wait in the
    checkpoint's collectives and they in the step's, forever), and all stop one step later."""
    stop = loop.StopRequest()

    def answers(mine, call):
        if call == 1:
            stop(signal.SIGTERM, None)  # the handler, run as the exchange returns
        return [mine, 0]

    sent = _two_process_exchange(monkeypatch, answers)
    assert stop.agreed() is None
    assert stop.agreed() == "SIGTERM"
    assert sent == [0, signal.SIGTERM.value]


def test_a_signal_to_another_process_stops_this_one(monkeypatch):
    stop = loop.StopRequest()
    _two_process_exchange(monkeypatch, lambda mine, call: [mine, signal.SIGINT.value])
    assert stop.agreed() == "SIGINT" and stop.signal == "SIGINT"
