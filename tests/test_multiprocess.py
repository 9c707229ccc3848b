"""Multi-process runs on CPU: `launch.multiprocess`, `runtime.initialize`'s job detection, and
pretraining on 2 processes x 4 devices against 1 process x 8 devices (this test process)."""

import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import config as config_lib
from composer_jax.parallel.multihost import LeaderChannel
from composer_jax.train import loop, read_metrics, run_pretraining
from composer_jax.train.runs import resolve_tokenizer
from launch import runtime
from tests.train.helpers import make_corpus, tiny_experiment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "launch.multiprocess", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _experiment(workdir, corpus, steps: int, full: bool = False) -> config_lib.ExperimentConfig:
    """Tiny float32 pretraining whose batch of 4 puts 8 devices at fsdp=4 x cp=2, so data,
    context and expert parallelism all cross the two processes. Fast: one phase, one MoE layer,
    no MTP (one quick compilation). `full`: the test model (dense + MoE layers, MTP) over two
    phases (batches 8 then 4)."""
    phases = (config_lib.PhaseConfig(seq_len=32, batch_size=4),)
    if full:
        phases = (
            config_lib.PhaseConfig("main", 0.5, seq_len=32, batch_size=8),
            config_lib.PhaseConfig("long", 0.5, seq_len=64, batch_size=4, lr_scale=0.5),
        )
    cfg = tiny_experiment(str(workdir), corpus, steps, phases=phases)
    model = dataclasses.replace(cfg.model, dtype="float32")
    if not full:
        model = dataclasses.replace(model, num_layers=1, first_k_dense=0, num_mtp_layers=0)
    return dataclasses.replace(cfg, model=model)


def _config_file(path, workdir, corpus, steps: int, full: bool = False) -> str:
    """A config file for `--config=` (get_config) and for the probe (get_experiment)."""
    path.write_text(
        textwrap.dedent(f"""
        import ml_collections
        from composer_jax import config
        from tests.test_multiprocess import _experiment

        def get_experiment():
            return _experiment({str(workdir)!r}, {corpus!r}, {steps}, {full})

        def get_config():
            return ml_collections.ConfigDict(config.to_dict(get_experiment()))
    """)
    )
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("corpus")))


def _losses(workdir) -> dict[int, float]:
    records = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    return {m["step"]: m["loss"] for m in records if "loss" in m}


# ----------------------------------------------------------------------------- the launcher


def test_launcher_prefixes_output_and_stops_the_others_when_one_fails():
    start = time.monotonic()
    done = _launch(
        ["--num_processes=2", "--devices_per_process=3", "--grace_s=5", "--"]
        + ["tests.multiprocess_probe", "exit", "7"]
    )
    assert done.returncode == 7, done.stdout + done.stderr
    assert time.monotonic() - start < 60  # process 0 would sleep 120 s
    assert "[1] failing" in done.stderr
    assert "process 1 failed (status 7)" in done.stderr
    addresses = {line.split()[-1] for line in done.stdout.splitlines() if "coordinator" in line}
    assert len(addresses) == 1 and addresses.pop().startswith("127.0.0.1:")
    for index in range(2):
        flags = next(line for line in done.stdout.splitlines() if f"[{index}] xla_flags" in line)
        assert "--xla_force_host_platform_device_count=3" in flags.split()


def test_launcher_rejects_a_missing_module():
    done = _launch(["--num_processes=2"])
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("error: name the module")


# Slow tier: the channel's own probe (the RL step below, also slow, runs process 1 on process
# 0's commands through the same channel).
@pytest.mark.slow
def test_leader_channel_and_host_model_across_two_processes():
    import hashlib

    done = _launch(
        ["--num_processes=2", "--devices_per_process=2", "--"]
        + [
            "tests.multiprocess_probe",
            "channel",
        ]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rng = [np.random.default_rng(i) for i in range(12)]
    expected = [
        f"[1] received c{i} "
        + hashlib.sha256(rng[i].bytes(3_000_000 if i == 2 else 100 * i)).hexdigest()[:16]
        for i in range(12)
    ]
    assert [line for line in done.stdout.splitlines() if "received" in line] == expected
    assert done.stdout.count("host_model ok") == 2
    held = [f"{n:012d}" for n in range(12 - LeaderChannel.RETAINED, 12)]
    assert f"[0] commands held {held}" in done.stdout  # acknowledged ones were deleted


# Slow tier: the RL trainer's step on 8 devices equals one device in the default run
# (tests/actor/test_trainer.py), as does pretraining on two processes (below).
@pytest.mark.slow
@pytest.mark.slow_sample  # CI's multi-process run
def test_an_rl_step_on_two_processes_equals_one_process(tmp_path):
    """The RL trainer split over 2 processes x 4 devices (process 1 following process 0's
    commands) takes the same step as one process on 8 devices, and each process publishes its
    shards so that the sampler rebuilds the new version bitwise."""
    import pickle

    from composer_jax.actor.trainer import RLTrainer
    from composer_jax.model import init_model
    from composer_jax.train.step import split_model
    from composer_jax.weight_sync import LocalDirStore, WeightSubscriber
    from tests.multiprocess_probe import rl_step_config

    done = _launch(
        ["--num_processes=2", "--devices_per_process=4", "--"]
        + ["tests.multiprocess_probe", "rl_step", str(tmp_path)]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "batch.pkl", "rb") as f:
        batch = pickle.load(f)
    with open(tmp_path / "metrics.json") as f:
        two = json.load(f)

    cfg = rl_step_config(str(tmp_path / "one"))
    _, params, buffers = split_model(init_model(cfg.model, 0))
    trainer = RLTrainer(cfg, params, buffers, str(tmp_path / "one-weights"))
    one = trainer.step(batch)
    assert one["grad_norm"] > 0
    for key in ("loss", "grad_norm", "kl_k1"):
        np.testing.assert_allclose(two[key], one[key], rtol=1e-5, atol=1e-7, err_msg=key)
    with np.load(tmp_path / "params.npz") as saved:
        got = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    want = [np.asarray(x) for x in jax.tree.leaves(trainer.state.params)]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)

    subscriber = WeightSubscriber(LocalDirStore(str(tmp_path / "weights")), process_count=2)
    assert subscriber.update() == 1
    rebuilt = jax.tree.leaves(subscriber.tree_like(trainer.state.params))
    for r, g in zip(rebuilt, got):
        np.testing.assert_array_equal(
            np.asarray(r).view(np.uint16), g.astype(jnp.bfloat16).view(np.uint16)
        )
    trainer.close()


# ----------------------------------------------------------------------------- job detection


def test_distributed_arguments(monkeypatch):
    for name in (*runtime.EXPLICIT_VARIABLES, "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert runtime.distributed_arguments() is None
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1234")
    with pytest.raises(SystemExit, match="JAX_NUM_PROCESSES, JAX_PROCESS_ID"):
        runtime.distributed_arguments()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert runtime.distributed_arguments() == {
        "coordinator_address": "127.0.0.1:1234",
        "num_processes": 2,
        "process_id": 1,
    }
    for name in runtime.EXPLICIT_VARIABLES:
        monkeypatch.delenv(name)
    # JAX's own detection: a SLURM step (JAX then reads the coordinates itself).
    slurm = {
        "SLURM_JOB_ID": "17",
        "SLURM_STEP_NODELIST": "node1",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    assert runtime.distributed_arguments() == {}


def test_sigusr1_prints_every_threads_stack():
    """What a hung job's processes are doing, without a debugger: `kill -USR1` after
    `runtime.initialize`."""
    program = textwrap.dedent("""
        import threading, time
        from absl import app
        from launch import runtime

        def waiting_in_a_worker_thread():
            time.sleep(60)

        def main(argv):
            runtime.initialize()
            threading.Thread(target=waiting_in_a_worker_thread, daemon=True).start()
            print("ready", flush=True)
            time.sleep(60)

        app.run(main)
    """)
    process = subprocess.Popen(
        [sys.executable, "-c", program],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in process.stdout:  # after runtime's own log line
            if line == "ready\n":
                break
        process.send_signal(signal.SIGUSR1)
        time.sleep(1)
        assert process.poll() is None  # the dump does not stop the job
    finally:
        process.kill()
    stderr = process.communicate()[1]
    assert "in waiting_in_a_worker_thread" in stderr and "in main" in stderr, stderr[-3000:]


# ----------------------------------------------------------------------------- data sharding


def test_processes_hold_disjoint_rows_that_make_the_single_process_batch(tmp_path, corpus):
    config_py = _config_file(tmp_path / "cfg.py", tmp_path / "unused", corpus, steps=2)
    done = _launch(
        ["--num_processes=2", "--devices_per_process=4", "--"]
        + ["tests.multiprocess_probe", "batch", config_py, str(tmp_path)]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cfg = _experiment(tmp_path / "unused", corpus, 2)
    layout = loop.make_train_setup(cfg).layout
    assert dict(layout.mesh.shape) == {"replica": 1, "fsdp": 4, "cp": 2}
    corpora = loop._Corpora(loop.open_corpus(cfg), resolve_tokenizer(cfg))
    want = loop._global_batch(next(loop._make_iterator(cfg, corpora, 0)), layout)
    for key, array in want.items():
        full = np.asarray(array)
        covered = np.zeros(full.shape, int)
        devices = set()
        for index in range(2):
            with np.load(tmp_path / f"{index}.npz") as shards:
                for name in shards.files:
                    if name.startswith(f"{key}/") and not name.endswith("/index"):
                        devices.add(name)
                        rows, cols = shards[f"{name}/index"]
                        piece = shards[name]
                        region = (
                            slice(rows, rows + piece.shape[0]),
                            slice(cols, cols + piece.shape[1]),
                        )
                        np.testing.assert_array_equal(piece, full[region])
                        covered[region] += 1
        assert len(devices) == 8
        assert (covered == 1).all()  # disjoint, and together the whole batch


# ----------------------------------------------------------------------------- pretraining


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory, corpus):
    """1 process x 8 devices (this process), 3 steps; made on first use per variant."""
    runs = {}

    def get(full: bool):
        if full not in runs:
            workdir = tmp_path_factory.mktemp("one_process") / "run"
            run_pretraining(_experiment(workdir, corpus, 3, full), progress=False)
            runs[full] = workdir
        return runs[full]

    return get


def _final_params(workdir) -> dict:
    model, _ = loop.load_trained_model(str(workdir))
    from flax import nnx

    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model)))
    }


@pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_two_processes_train_like_one(tmp_path, corpus, reference_runs, full):
    """Losses and final parameters of 2 x 4 devices equal 1 x 8; the 2-process checkpoint
    restores here (1 process); only process 0 writes the run's records."""
    reference_run = reference_runs(full)
    workdir = tmp_path / "run"
    config_py = _config_file(tmp_path / "cfg.py", workdir, corpus, 3, full)
    done = _launch(
        ["--num_processes=2", "--devices_per_process=4", "--"]
        + ["launch.pretrain", "--noprogress", f"--config={config_py}"]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[1] process 1 of 2, 4 local device(s) of 8" in done.stdout

    want, got = _losses(reference_run), _losses(workdir)
    assert sorted(got) == [1, 2, 3]
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-4 * abs(want[step]), (step, got, want)
    want_params, got_params = _final_params(reference_run), _final_params(workdir)
    assert want_params.keys() == got_params.keys()
    for name in want_params:
        np.testing.assert_allclose(got_params[name], want_params[name], rtol=1e-4, atol=1e-6)

    # One writer: one line per step and per launch, the launch records both processes.
    steps = [m["step"] for m in read_metrics(os.path.join(workdir, "metrics.jsonl"))]
    assert steps.count(1) == 1
    launches = (workdir / "launches.jsonl").read_text().splitlines()
    assert len(launches) == 1 and json.loads(launches[0])["devices"]["processes"] == 2
    assert (workdir / "config.json").exists()


@pytest.mark.slow
def test_one_process_checkpoint_resumes_on_two(tmp_path, corpus, reference_runs):
    """The 1-process run continued on 2 processes matches it continued on 1."""
    reference_run = reference_runs(False)
    on_one, on_two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(reference_run, on_one)
    shutil.copytree(reference_run, on_two)
    longer = dataclasses.replace(_experiment(on_one, corpus, 5), resume="must")
    run_pretraining(longer, progress=False)
    config_py = _config_file(tmp_path / "cfg.py", on_two, corpus, steps=5)
    done = _launch(
        ["--num_processes=2", "--devices_per_process=4", "--"]
        + ["launch.pretrain", "--noprogress", f"--config={config_py}", "--config.resume=must"]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Resumed from" in done.stdout
    want, got = _losses(on_one), _losses(on_two)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in (4, 5):
        assert abs(got[step] - want[step]) <= 1e-4 * abs(want[step]), (step, got, want)
    assert glob.glob(str(on_two / "checkpoints" / "5"))


def _stacks_and_kill(process) -> str:
    """The output of a hung launcher with every child's Python stacks (`runtime.initialize`
    prints them on SIGUSR1), after which the whole job is killed."""
    import psutil

    for child in psutil.Process(process.pid).children():
        child.send_signal(signal.SIGUSR1)
    time.sleep(3)
    for child in psutil.Process(process.pid).children(recursive=True):
        child.kill()
    process.kill()
    output, _ = process.communicate()
    return output


# Slow tier: its two-process start dominates; the two-process equality tests stay default.
@pytest.mark.slow
def test_a_signal_to_one_process_stops_both_at_the_same_step(tmp_path, corpus):
    """A scheduler's SIGTERM reaches hosts at different steps: the processes agree on the stop
    (without that, the signalled one waits in the checkpoint's collectives and the other in the
    next step's, forever), both save that step and exit with the signal's status."""
    import psutil

    workdir = tmp_path / "run"
    config = _config_file(tmp_path / "config.py", workdir, corpus, steps=500)
    args = ["--num_processes=2", "--devices_per_process=4", "--", "launch.pretrain"]
    process = subprocess.Popen(
        [sys.executable, "-m", "launch.multiprocess", *args, f"--config={config}", "--noprogress"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        metrics = workdir / "metrics.jsonl"
        while not metrics.exists() or max(_losses(workdir), default=0) < 2:
            assert process.poll() is None, process.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the job never reached step 2"
            time.sleep(0.2)
        (second,) = [
            child
            for child in psutil.Process(process.pid).children()
            if child.environ().get("JAX_PROCESS_ID") == "1"
        ]
        second.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail("the job did not stop within 180 s:\n" + _stacks_and_kill(process)[-12000:])
    finally:
        if process.poll() is None:
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, output[-3000:]
    stopped = max(_losses(workdir))
    # Whichever process ends first may see the launcher stop the other before it prints.
    assert stopped < 500 and re.search(
        rf"\[[01]\] Stopped by SIGTERM; step {stopped} is saved", output
    )
    assert str(stopped) in os.listdir(workdir / "checkpoints")
