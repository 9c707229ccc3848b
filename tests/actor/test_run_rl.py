"""`python -m launch.rl` end to end: kill -9 and restart keep exactly-once training (groups in
flight resume from their saved state); Ray backend with one sampler and with two."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from composer_jax.actor.ids import GroupId
from composer_jax.actor.ledger import GroupLedger
from composer_jax.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, GROUPS_PER_STEP = 6, 2


def _args(workdir, *extra):
    args = [
        sys.executable,
        "-m",
        "launch.rl",
        f"--config.workdir={workdir}",
        "--config.rl.warm_start_steps=4",
        f"--config.steps={STEPS}",
        "--config.train.checkpoint_every=2",
        "--config.rl.heldout.num_tasks=2",
        "--config.rl.heldout.samples=1",
        "--config.rl.rollout.group_size=2",
        f"--config.rl.rollout.groups_per_step={GROUPS_PER_STEP}",
        "--config.rl.rollout.num_slots=4",
        "--config.rl.rollout.context_len=512",
        "--config.rl.rollout.max_new_tokens=24",
        "--config.rl.agent.max_turns=2",  # samples wait between turns: in-flight records matter
        "--config.rl.rollout.max_staleness=8",  # nothing dropped: every prompt must be trained once
        "--config.rl.rollout.skip_uniform_groups=False",
        "--config.rl.rollout.num_prompts=0",  # steps x groups_per_step: one epoch, all trained
        "--progress=false",
        *extra,
    ]
    if "--config.rl.rollout.backend=ray" not in extra:  # Ray's environment workers are actors
        args.append("--config.rl.rollout.env_workers=thread")
    return args


def _rl_steps(workdir) -> list[int]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [m["step"] for m in read_metrics(path) if "reward_mean" in m]


def _check_finished_run(workdir, allow_dropped: bool = False):
    """Steps 1..STEPS each trained once, every prompt trained exactly once. `allow_dropped`:
    groups sampled by weights newer than the restored checkpoint may have been dropped (their
    prompts sampled again), which happens when a process outlives the kill long enough to
    sample with them."""
    ledger = GroupLedger(os.path.join(workdir, "ledger"))
    prompts = {f"p{i:05d}" for i in range(STEPS * GROUPS_PER_STEP)}
    consumed = {}
    for name in os.listdir(os.path.join(workdir, "ledger", "consumed")):
        with open(os.path.join(workdir, "ledger", "consumed", name)) as f:
            record = json.load(f)
        if allow_dropped and name.startswith("dropped-"):
            continue
        assert name.startswith("trained-"), name  # nothing was dropped
        consumed[record["step"]] = record["group_ids"]
    assert sorted(consumed) == list(range(1, STEPS + 1))
    trained_ids = [gid for ids in consumed.values() for gid in ids]
    trained = [GroupId.parse(gid).prompt for gid in trained_ids]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    assert set(trained) == prompts, "a prompt was lost or an unknown group trained"
    assert all(ledger.trained_step(gid) is not None for gid in trained_ids)
    assert _rl_steps(workdir) == list(range(1, STEPS + 1))
    heldout = [
        m for m in read_metrics(os.path.join(workdir, "metrics.jsonl")) if "heldout_reward" in m
    ]
    assert [m["step"] for m in heldout] == [0, STEPS]
    assert os.path.exists(os.path.join(workdir, "rl_curves.png"))
    # The groups in flight were saved with the last checkpoints (the newest two are kept).
    assert sorted(os.listdir(os.path.join(workdir, "inflight"))) == [
        f"step-{step:09d}.pkl" for step in (STEPS - 2, STEPS)
    ]


# Slow tier (two processes, killed mid-run): crash-resume from in-flight records stays in the
# default run through tests/actor/test_coordinator.py.
@pytest.mark.slow
@pytest.mark.slow_sample  # CI's interrupted RL run
@pytest.mark.timeout(900)  # two runs: about 2 minutes on a fast machine, 5 on a slow loaded one
def test_kill_9_mid_run_resumes_without_losing_or_repeating_groups(tmp_path):
    workdir = str(tmp_path / "run")
    process = subprocess.Popen(
        _args(workdir), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 600
    while not any(s >= 3 for s in _rl_steps(workdir)):
        assert process.poll() is None, process.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the run never reached step 3"
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = max(_rl_steps(workdir))
    assert killed_at < STEPS

    restart = subprocess.run(_args(workdir), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert restart.returncode == 0, restart.stdout[-3000:] + restart.stderr[-3000:]
    assert "Resumed RL at step" in restart.stdout
    _check_finished_run(workdir)
    with open(os.path.join(workdir, "launches.jsonl")) as f:
        launches = [json.loads(line) for line in f]
    assert [r["kind"] for r in launches] == ["rl", "rl"]
    resumed_at = int(re.search(r"Resumed RL at step (\d+)", restart.stdout).group(1))
    assert [r["resumed_step"] for r in launches] == [None, resumed_at or None]


# The slow tier's: a local Ray cluster starts in tens of seconds; Ray's environment workers and
# placement stay in the default run (tests/actor/test_env_workers.py, test_ray_placement.py).
@pytest.mark.slow
@pytest.mark.parametrize("num_samplers", [1, 2])
def test_ray_backend_runs_the_same_smoke_test_on_a_local_cluster(tmp_path, num_samplers):
    workdir = str(tmp_path / "run")
    result = subprocess.run(
        _args(
            workdir,
            "--config.rl.rollout.backend=ray",
            f"--config.rl.rollout.num_samplers={num_samplers}",
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _check_finished_run(workdir)


def _process_of_job(launcher: subprocess.Popen, index: int):
    """The child of `launch.multiprocess` that is process `index` of the JAX job."""
    for child in psutil.Process(launcher.pid).children():
        if child.environ().get("JAX_PROCESS_ID") == str(index):
            return child
    raise AssertionError(f"no process {index} under the launcher")


# The slow tier's (2 minutes): the default run keeps the single-process kill -9 test, one RL step
# on two processes equal to one, and an error on process 0 stopping process 1.
@pytest.mark.slow
def test_two_processes_run_the_main_job_and_resume_after_kill_9_of_one(tmp_path):
    """Trainer over 2 processes x 4 devices, the actor loop on process 0: kill -9 of process 1
    mid-run, then both restart and finish with every group trained exactly once; process 0
    alone writes the ledger, metrics, launches and held-out results, each process publishes its
    shards of every weight version."""
    workdir = str(tmp_path / "run")
    launcher = [sys.executable, "-m", "launch.multiprocess", "--num_processes=2"]
    launcher += ["--devices_per_process=4", "--grace_s=5", "--"]
    command = launcher + _args(workdir)[2:]  # launch.rl and its flags
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while not any(s >= 3 for s in _rl_steps(workdir)):
        assert process.poll() is None, process.stdout.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the run never reached step 3"
        time.sleep(0.2)
    _process_of_job(process, 1).send_signal(signal.SIGKILL)
    first = process.communicate(timeout=120)[0].decode()
    assert process.returncode != 0
    assert "process 1 failed" in first, first[-3000:]
    assert max(_rl_steps(workdir)) < STEPS

    restart = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert restart.returncode == 0, restart.stdout[-3000:] + restart.stderr[-3000:]
    assert "[0] Resumed RL at step" in restart.stdout
    assert "[1] Resumed RL" not in restart.stdout  # the ledger is process 0's alone
    # Process 0 outlives process 1 by the launcher's grace period, sampling with weights the
    # restored checkpoint never had: those groups are dropped and their prompts sampled again.
    _check_finished_run(workdir, allow_dropped=True)
    with open(os.path.join(workdir, "launches.jsonl")) as f:
        launches = [json.loads(line) for line in f]
    assert [(r["kind"], r["devices"]["processes"]) for r in launches] == [("rl", 2), ("rl", 2)]
    with open(os.path.join(workdir, "heldout.json")) as f:
        assert len(json.load(f)) == 2  # before RL, after it: each evaluated once
    manifests = os.path.join(workdir, "weights", "attempt-1", "manifests")
    for version in os.listdir(manifests):
        assert sorted(os.listdir(os.path.join(manifests, version))) == [
            "00000-of-00002.json",
            "00001-of-00002.json",
        ]


# Slow tier: two processes; a run stopping cleanly on an error stays in the default run
# (tests/train/test_loop.py, the non-finite loss).
@pytest.mark.slow
def test_an_error_on_process_0_stops_the_other_processes_at_once(tmp_path):
    """Process 1 waits for process 0's commands; when process 0 fails (here on a held-out split
    its task source lacks, found after the shared warm start) process 1 says so and exits too,
    rather than waiting for the distributed runtime's timeouts."""
    workdir = str(tmp_path / "run")
    launcher = [sys.executable, "-m", "launch.multiprocess", "--num_processes=2"]
    launcher += ["--devices_per_process=4", "--"]
    args = _args(workdir, "--config.rl.warm_start_steps=1", "--config.rl.heldout.split=nope")
    done = subprocess.run(
        launcher + args[2:], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[0] error: rl.heldout.split:" in done.stderr
    assert "[1] error: process 0 stopped on ConfigError: rl.heldout.split:" in done.stderr
