"""Environment worker pools: oracle episodes through every kind match in-process episodes; a
killed or hung worker loses only its own episodes and is replaced; worker processes never
import JAX."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from composer_jax import envs
from composer_jax.actor.env_workers import POOL_KINDS, EnvWorkerError, ProcessEnvironmentPool
from composer_jax.actor.ray_backend import RayEnvironmentPool
from composer_jax.actor.roles import make_environment_pool
from composer_jax.actor.thread_pool import ThreadEnvironmentPool
from composer_jax.envs import worker as env_worker

# Slow enough that a signal lands while the worker is inside the call.
SLOW_TURN = envs.render_turn(calls=(("run_shell", {"command": "sleep 10"}),))


@pytest.fixture(scope="module")
def tasks():
    return envs.builtin_tasks(4, seed=23)


@pytest.fixture(scope="module")
def references(tasks):
    return [envs.run_episode(task, envs.oracle_turns(task)) for task in tasks]


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    # "local": a new instance even while another test's cluster runs on this machine (ray.init
    # would join that one, and refuse num_cpus).
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def play(pool, episodes, config=envs.EnvConfig()):
    """Runs {episode_id: (task, turns)} concurrently, turn by turn; the last results by id."""
    prompts = {eid: pool.start(eid, task, config) for eid, (task, _) in episodes.items()}
    for eid, future in prompts.items():
        assert future.result(timeout=60).startswith(episodes[eid][0].prompt)
    results = {}
    for turn in range(max(len(turns) for _, turns in episodes.values())):
        futures = {eid: pool.step(eid, turns[turn]) for eid, (_, turns) in episodes.items()}
        results = {eid: future.result(timeout=60) for eid, future in futures.items()}
    for eid in episodes:
        pool.close(eid)
    return results


def oracle(task):
    return task, envs.oracle_turns(task)


def wait_for_child(pid, timeout_s=20.0):
    """Waits until process `pid` has a child: the sandboxed command of the call is running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == pid:
                return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} started no command")


@pytest.mark.parametrize("kind", POOL_KINDS)
def test_oracle_episodes_match_in_process(kind, tasks, references, request):
    if kind == "ray":
        request.getfixturevalue("ray_session")
    with make_environment_pool(kind, num_workers=2, timeout_s=60.0) as pool:
        results = play(pool, {f"e{i}": oracle(task) for i, task in enumerate(tasks)})
        health = pool.health()
    for i, reference in enumerate(references):
        assert reference.done and reference.reward == 1.0
        assert results[f"e{i}"] == reference
    assert health["calls"] == 3 * len(tasks)
    assert health["worker_crashes"] == health["worker_timeouts"] == health["episodes_lost"] == 0


def test_flags_and_config_cross_the_pipe(tasks):
    config = envs.EnvConfig(
        strict_tools=False,
        max_turns=4,
        max_output_bytes=512,
        limits=envs.SandboxLimits(cpu_seconds=5, wall_seconds=10.0, output_bytes=4096),
    )
    assert env_worker.config_from_json(env_worker.config_to_json(config)) == config
    network = envs.render_turn(calls=(("run_shell", {"command": "echo no curl here"}),))
    turns = [network, *envs.oracle_turns(tasks[0])]
    reference = envs.run_episode(tasks[0], turns, config)
    assert [flag.kind for flag in reference.flags] == ["network"] and reference.reward == 0.0
    with ProcessEnvironmentPool(num_workers=1) as pool:
        assert play(pool, {"flagged": (tasks[0], turns)}, config)["flagged"] == reference


def test_a_pools_default_timeout_covers_the_slowest_legitimate_step():
    """Without a timeout, a pool waits as long as a step of the default environment may take
    (slow commands on every call of a turn, then grading), not a fixed minute."""
    slowest = envs.EnvConfig().step_seconds()
    assert slowest > 60
    with ThreadEnvironmentPool(max_workers=1) as threads:
        assert threads.timeout_s == slowest
    with ProcessEnvironmentPool(num_workers=1) as processes:
        assert processes.timeout_s == slowest


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_unknown_and_duplicate_ids(kind, tasks):
    with make_environment_pool(kind, num_workers=1, timeout_s=60.0) as pool:
        with pytest.raises(KeyError):
            pool.step("nobody", "<final>x</final>").result(timeout=30)
        pool.close("nobody")
        assert pool.start("e", tasks[0]).result(timeout=60)
        with pytest.raises(ValueError, match="already started"):
            pool.start("e", tasks[1]).result(timeout=60)
        pool.close("e")
        with pytest.raises(KeyError):
            pool.step("e", "<final>x</final>").result(timeout=30)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.step("e", "<final>x</final>")


def test_make_environment_pool_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="kind"):
        make_environment_pool("fork", num_workers=1, timeout_s=1.0)


def test_process_worker_killed_mid_call(tasks):
    with ProcessEnvironmentPool(num_workers=2, timeout_s=30.0) as pool:
        for i, task in enumerate(tasks[:3]):
            pool.start(f"e{i}", task).result(timeout=60)
        assert [pool.worker_of(f"e{i}") for i in range(3)] == [0, 1, 0]  # least loaded
        victim = pool.worker_pids()[0]
        slow = pool.step("e0", SLOW_TURN)
        wait_for_child(victim)
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(EnvWorkerError, match="SIGKILL"):
            slow.result(timeout=30)
        health = pool.health()
        assert health["worker_crashes"] == 1 and health["workers_replaced"] == 1
        assert health["episodes_lost"] == 1 and health["workers_started"] == 3
        assert health["episodes_rerun"] == 1  # e2, the killed worker's other episode
        assert pool.worker_pids()[0] != victim
        lost = pool.step("e0", envs.oracle_turns(tasks[0])[0])
        assert lost.done() and isinstance(lost.exception(), EnvWorkerError)
        pool.close("e0")
        # The re-run episode, the other worker's and a new one on the fresh worker all finish.
        for episode, task in (("e2", tasks[2]), ("e1", tasks[1])):
            for turn in envs.oracle_turns(task):
                survivor = pool.step(episode, turn).result(timeout=60)
            assert survivor.done and survivor.reward == 1.0
        assert play(pool, {"new": oracle(tasks[3])})["new"].reward == 1.0


def test_a_slow_step_loses_only_its_own_episode(tasks):
    """Two episodes on one worker, one mid-way: the other's step runs past the timeout. Only the
    slow one is lost; the first is re-run on the fresh worker from its start and its steps, so
    its next turn sees the workspace its earlier turns left, its queued step included."""
    turns = envs.oracle_turns(tasks[0])
    assert len(turns) > 1
    with ProcessEnvironmentPool(num_workers=1, timeout_s=3.0) as pool:
        pool.start("kept", tasks[0]).result(timeout=60)
        pool.start("slow", tasks[1]).result(timeout=60)
        pool.step("kept", turns[0]).result(timeout=60)
        slow = pool.step("slow", SLOW_TURN)
        queued = pool.step("kept", turns[1])  # behind the slow step on the same worker
        with pytest.raises(EnvWorkerError, match="timed out"):
            slow.result(timeout=30)
        result = queued.result(timeout=60)
        for turn in turns[2:]:
            result = pool.step("kept", turn).result(timeout=60)
        assert result.done and result.reward == 1.0
        health = pool.health()
        assert health["worker_timeouts"] == 1 and health["episodes_lost"] == 1
        assert health["episodes_rerun"] == 1


def test_a_killed_worker_leaves_no_temporary_folders(tasks, tmp_path, monkeypatch):
    """What a worker keeps for its life (workspaces, the sandbox's made-up /etc) lies under the
    folder the pool removes when the worker is gone, so kill -9 leaks nothing."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with ProcessEnvironmentPool(num_workers=1, timeout_s=30.0) as pool:
        assert play(pool, {"graded": oracle(tasks[0])})["graded"].reward == 1.0
        pool.start("open", tasks[1]).result(timeout=60)
        os.kill(pool.worker_pids()[0], signal.SIGKILL)
        with pytest.raises(EnvWorkerError, match="SIGKILL"):
            pool.step("open", envs.oracle_turns(tasks[1])[0]).result(timeout=30)
        pool.close("open")
        assert play(pool, {"after": oracle(tasks[2])})["after"].reward == 1.0
    assert os.listdir(tmp_path) == []


def test_process_worker_hang_times_out(tasks):
    with ProcessEnvironmentPool(num_workers=1, timeout_s=3.0) as pool:
        pool.start("hung", tasks[0]).result(timeout=30)
        victim = pool.worker_pids()[0]
        os.kill(victim, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EnvWorkerError, match="timed out"):
            pool.step("hung", envs.oracle_turns(tasks[0])[0]).result(timeout=30)
        assert 3.0 <= time.monotonic() - start < 15.0
        health = pool.health()
        assert health["worker_timeouts"] == 1 and health["workers_replaced"] == 1
        assert health["episodes_lost"] == 1 and health["worker_crashes"] == 0
        assert pool.worker_pids()[0] != victim
        assert play(pool, {"after": oracle(tasks[1])})["after"].reward == 1.0


def test_thread_call_past_timeout_loses_the_episode(tasks):
    with ThreadEnvironmentPool(max_workers=2, timeout_s=2.0) as pool:
        pool.start("slow", tasks[0]).result(timeout=30)
        with pytest.raises(EnvWorkerError, match="timed out"):
            pool.step("slow", SLOW_TURN).result(timeout=30)
        health = pool.health()
        assert health["worker_timeouts"] == 1 and health["workers_replaced"] == 1
        assert health["episodes_lost"] == 1 and health["workers_started"] == 3
        lost = pool.step("slow", "<final>x</final>")
        assert lost.done() and isinstance(lost.exception(), EnvWorkerError)
        pool.close("slow")
        results = play(pool, {"a": oracle(tasks[1]), "b": oracle(tasks[2])})
        assert all(result.reward == 1.0 for result in results.values())


def test_ray_actor_killed_mid_call(ray_session, tasks):
    ray = ray_session
    with RayEnvironmentPool(num_workers=2, timeout_s=60.0) as pool:
        victim = pool.actors()[0]
        assert ray.get(victim.__ray_call__.remote(lambda host: "jax" in sys.modules)) is False
        victim_pid = ray.get(victim.pid.remote())  # asked now: the actor serialises its calls
        pool.start("e0", tasks[0]).result(timeout=60)
        pool.start("e1", tasks[1]).result(timeout=60)
        slow = pool.step("e0", SLOW_TURN)
        wait_for_child(victim_pid)
        ray.kill(victim)
        with pytest.raises(EnvWorkerError, match="died"):
            slow.result(timeout=60)
        health = pool.health()
        assert health["worker_crashes"] == 1 and health["workers_replaced"] == 1
        assert health["episodes_lost"] == 1 and health["workers_started"] == 3
        assert pool.actors()[0]._actor_id != victim._actor_id
        for turn in envs.oracle_turns(tasks[1]):
            survivor = pool.step("e1", turn).result(timeout=60)
        assert survivor.done and survivor.reward == 1.0
        assert play(pool, {"new": oracle(tasks[2])})["new"].reward == 1.0


def test_worker_process_never_imports_jax(tasks):
    """Drives the real worker loop through an episode, then reports its imports."""
    code = (
        "import runpy, sys\n"
        "runpy.run_module('composer_jax.envs.worker', run_name='__main__', alter_sys=True)\n"
        "print('imported jax:', 'jax' in sys.modules, file=sys.stderr)\n"
    )
    task = tasks[0]
    requests = [
        ("start", ("e", task.to_json(), env_worker.config_to_json(envs.EnvConfig()))),
        ("step", ("nobody", "<final>x</final>")),
        *(("step", ("e", turn)) for turn in envs.oracle_turns(task)),
    ]
    worker = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert env_worker.read_frame(worker.stdout) == (True, worker.pid)
    replies = []
    for request in requests:
        worker.stdin.write(env_worker.encode_frame(request))
        worker.stdin.flush()
        replies.append(env_worker.read_frame(worker.stdout))
    worker.stdin.close()
    stderr = worker.stderr.read().decode()
    assert worker.wait(timeout=30) == 0
    assert replies[0][0] and replies[0][1].startswith(task.prompt)
    assert not replies[1][0] and isinstance(replies[1][1], KeyError)
    assert replies[-1][0] and replies[-1][1].reward == 1.0
    assert "imported jax: False" in stderr


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_episode_resumes_from_a_snapshot_on_another_worker(kind, tasks):
    """The snapshot crosses the pool (and the pipe); the resumed episode ends like the original."""
    task = tasks[1]
    write, final = envs.oracle_turns(task)
    with make_environment_pool(kind, num_workers=2, timeout_s=60.0) as pool:
        pool.start("first", task).result(timeout=60)
        assert not pool.step("first", write).result(timeout=60).done
        snapshot = pool.snapshot("first").result(timeout=60)
        pool.close("first")
        assert pool.start("resumed", task, envs.EnvConfig(), snapshot).result(timeout=60)
        result = pool.step("resumed", final).result(timeout=60)
        with pytest.raises(ValueError, match="not an episode snapshot"):
            pool.start("bad", task, envs.EnvConfig(), {"format": 0}).result(timeout=60)
        with pytest.raises(KeyError):
            pool.snapshot("nobody").result(timeout=30)
    assert result.done and result.reward == 1.0 and result.counts["turns"] == 2


class _RecordingHost:
    """An episode host whose step is slow and whose snapshot reports the turns applied."""

    def __init__(self):
        self.turns, self.order = 0, []

    def step(self, episode_id, model_output):
        time.sleep(0.3)
        self.turns += 1
        self.order.append("step")
        return self.turns

    def snapshot(self, episode_id):
        self.order.append("snapshot")
        return {"turns": self.turns}

    def close(self, episode_id):
        self.order.append("close")

    def close_all(self):
        pass


def test_a_thread_pool_runs_each_episodes_calls_in_order():
    """A step, then a snapshot, then a close of one episode, with threads to spare: the snapshot
    waits for the step (it saw the turn only some of the time, a save could then replay it), the
    close for both; another episode's call does not wait behind them."""
    with ThreadEnvironmentPool(max_workers=4) as pool:
        host = pool._host = _RecordingHost()
        step = pool.step("e", "turn")
        snapshot = pool.snapshot("e")
        other = pool.snapshot("f")
        pool.close("e")
        assert other.result(timeout=5) == {"turns": 0} and not step.done()
        assert step.result(timeout=5) == 1 and snapshot.result(timeout=5) == {"turns": 1}
        deadline = time.monotonic() + 5
        while host.order[-1:] != ["close"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert host.order == ["snapshot", "step", "snapshot", "close"]


class _ShutdownOnRelease:
    """The pool's lock, which shuts the pool down (from another thread, to the end) the first
    time `caller` releases it: between any two holds of the lock within one call."""

    def __init__(self, pool, caller):
        self.pool, self.lock, self.caller, self.armed = pool, pool._lock, caller, True

    def __enter__(self):
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()
        if self.armed and threading.current_thread() is self.caller:
            self.armed = False
            shutdown = threading.Thread(target=self.pool.shutdown)
            shutdown.start()
            shutdown.join()


@pytest.mark.parametrize("method", ["step", "snapshot"])
def test_a_thread_pool_shut_down_during_a_call_still_completes_it(method):
    """A shutdown landing inside a call (after it was checked): the call's future completes (run
    or failed), never waits forever behind the threads' stop markers."""
    pool = ThreadEnvironmentPool(max_workers=1, timeout_s=5)
    pool._host = _RecordingHost()
    pool._lock = _ShutdownOnRelease(pool, threading.current_thread())
    args = ("e", "turn") if method == "step" else ("e",)
    future = getattr(pool, method)(*args)
    done, _ = concurrent.futures.wait([future], timeout=5)
    assert done, f"{method} never completed"
    with pytest.raises(RuntimeError, match="shut down"):
        pool.step("e", "turn")
