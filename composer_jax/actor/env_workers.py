"""Environment worker pools for the asynchronous actor loop: episodes by id, calls as futures.

An episode stays on the worker that started it (its workspace lives there). When a worker dies
or a call runs past `timeout_s`, the worker is killed and replaced and the episode whose call it
was is lost (its futures fail with `EnvWorkerError`, later steps fail at once); the worker's other
episodes are re-run on the fresh worker from their start and the steps they took, so they carry
on where they were (`WorkerPool`); the pool carries on and `health()` counts what happened. Workers are child processes (`ProcessEnvironmentPool`), threads
of this process (`thread_pool.ThreadEnvironmentPool`: for small hosts and tests) or Ray actors
(`ray_backend.RayEnvironmentPool`). The worker side is `composer_jax.envs.worker`, which never imports JAX;
the parent's end of a worker process is `composer_jax.actor.worker_process`.
"""

import concurrent.futures
import dataclasses
import logging
import queue
import threading

from composer_jax.actor.worker_process import WorkerCrash, WorkerProcess, WorkerTimeout
from composer_jax.envs import worker as env_worker
from composer_jax.envs.environment import EnvConfig
from composer_jax.envs.grading.task import Task
from composer_jax.trace import NULL_TRACER

log = logging.getLogger(__name__)

HEALTH_KEYS = (
    "workers_started",
    "worker_crashes",
    "worker_timeouts",
    "workers_replaced",
    "episodes_lost",
    "episodes_rerun",
    "calls",
)
POOL_KINDS = ("process", "thread", "ray")


class EnvWorkerError(RuntimeError):
    """The worker running an episode crashed or timed out: the episode is lost."""


@dataclasses.dataclass(eq=False)
class Call:
    episode_id: str
    method: str
    args: tuple
    future: concurrent.futures.Future | None


def running_future() -> concurrent.futures.Future:
    """A future the caller cannot cancel, so the pool completes each one exactly once."""
    future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    return future


def failed_future(error: Exception) -> concurrent.futures.Future:
    future = running_future()
    future.set_exception(error)
    return future


def lost_error(episode_id: str) -> EnvWorkerError:
    return EnvWorkerError(f"episode {episode_id!r} was lost with its worker")


def fail_all(calls: list[Call], message: str) -> None:
    for call in calls:
        if call.future is not None:
            call.future.set_exception(EnvWorkerError(message))


class EnvironmentPool:
    """What the actor loop drives. Futures are completed outside the pool's lock, so their
    callbacks may call the pool. Assign `tracer` to record each call on its worker's track."""

    tracer = NULL_TRACER

    def __init__(self, timeout_s: float | None):
        """`timeout_s`: how long one call may run before its worker counts as hung; None, the
        longest a step of the default environment may legitimately take
        (`EnvConfig.step_seconds`, from which the RL launcher derives its own)."""
        timeout_s = EnvConfig().step_seconds() if timeout_s is None else timeout_s
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(HEALTH_KEYS, 0)
        self._lost: set[str] = set()
        self._closed = False

    def start(
        self,
        episode_id: str,
        task: Task,
        config: EnvConfig = EnvConfig(),
        snapshot: dict | None = None,
    ) -> concurrent.futures.Future:
        """A future of the episode's prompt (`Episode.prompt`); with `snapshot` (from
        `snapshot()`), the episode resumes where that one was."""
        raise NotImplementedError

    def step(self, episode_id: str, model_output: str) -> concurrent.futures.Future:
        """A future of the `StepResult`."""
        raise NotImplementedError

    def snapshot(self, episode_id: str) -> concurrent.futures.Future:
        """A future of the episode's state between turns (`Episode.snapshot`); ask while no
        step of the episode is pending."""
        raise NotImplementedError

    def close(self, episode_id: str) -> None:
        """Frees the episode; never raises (unknown and lost ids are ignored)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Fails queued calls, lets running ones end (within `timeout_s`), frees every episode."""
        raise NotImplementedError

    def health(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the environment pool is shut down")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


class _Slot:
    """One worker position: its current worker, its episodes and its queue of calls."""

    def __init__(self, index: int):
        self.index = index
        self.worker = None
        self.episodes: set[str] = set()
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.launched = threading.Event()
        self.launch_error: Exception | None = None
        self.thread: threading.Thread | None = None


@dataclasses.dataclass
class _History:
    """What rebuilds an episode on a fresh worker: its start's arguments and the steps taken."""

    start: tuple
    steps: list[str] = dataclasses.field(default_factory=list)


class WorkerPool(EnvironmentPool):
    """Episodes pinned to long-lived workers (the least loaded at start); one I/O thread per
    worker serialises its calls, calls to different workers run in parallel. Subclasses say how
    to launch a worker: a handle with `call(request, timeout_s)` (raising `WorkerCrash` or
    `WorkerTimeout`), `kill()` and `stop(timeout_s)`."""

    def __init__(self, num_workers: int, timeout_s: float | None):
        super().__init__(timeout_s)
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self._slots = [_Slot(index) for index in range(num_workers)]
        self._where: dict[str, _Slot] = {}
        self._history: dict[str, _History] = {}
        for slot in self._slots:
            slot.thread = threading.Thread(
                target=self._serve, args=(slot,), name=f"env-worker-{slot.index}", daemon=True
            )
            slot.thread.start()
        for slot in self._slots:
            slot.launched.wait()
        failed = [slot for slot in self._slots if slot.worker is None]
        if failed:
            self.shutdown()
            raise RuntimeError(
                f"could not start environment worker(s) {[slot.index for slot in failed]}: "
                f"{failed[0].launch_error}"
            ) from failed[0].launch_error

    def _launch(self):
        raise NotImplementedError

    def start(
        self,
        episode_id: str,
        task: Task,
        config: EnvConfig = EnvConfig(),
        snapshot: dict | None = None,
    ) -> concurrent.futures.Future:
        args = (episode_id, task.to_json(), env_worker.config_to_json(config))
        if snapshot is not None:
            args += (snapshot,)
        with self._lock:
            self._check_open()
            self._counters["calls"] += 1
            if episode_id in self._where or episode_id in self._lost:
                return failed_future(ValueError(f"episode {episode_id!r} already started"))
            slot = min(self._slots, key=lambda slot: len(slot.episodes))
            slot.episodes.add(episode_id)
            self._where[episode_id] = slot
            return self._submit(slot, Call(episode_id, "start", args, running_future()))

    def step(self, episode_id: str, model_output: str) -> concurrent.futures.Future:
        with self._lock:
            self._check_open()
            self._counters["calls"] += 1
            if episode_id in self._lost:
                return failed_future(lost_error(episode_id))
            slot = self._where.get(episode_id)
            if slot is None:
                return failed_future(KeyError(f"unknown episode {episode_id!r}"))
            call = Call(episode_id, "step", (episode_id, model_output), running_future())
            return self._submit(slot, call)

    def snapshot(self, episode_id: str) -> concurrent.futures.Future:
        with self._lock:
            self._check_open()
            if episode_id in self._lost:
                return failed_future(lost_error(episode_id))
            slot = self._where.get(episode_id)
            if slot is None:
                return failed_future(KeyError(f"unknown episode {episode_id!r}"))
            return self._submit(slot, Call(episode_id, "snapshot", (episode_id,), running_future()))

    def close(self, episode_id: str) -> None:
        with self._lock:
            self._lost.discard(episode_id)
            self._history.pop(episode_id, None)
            slot = self._where.pop(episode_id, None)
            if slot is not None:
                slot.episodes.discard(episode_id)
                if not self._closed:
                    slot.calls.put(Call(episode_id, "close", (episode_id,), None))

    def worker_of(self, episode_id: str) -> int | None:
        """The index of the worker holding the episode (None: unknown or lost)."""
        with self._lock:
            slot = self._where.get(episode_id)
            return None if slot is None else slot.index

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = [call for slot in self._slots for call in self._drain(slot)]
            self._where.clear()
            self._history.clear()
            for slot in self._slots:
                slot.episodes.clear()
                slot.calls.put(None)
        fail_all(pending, "the environment pool was shut down")
        for slot in self._slots:
            slot.thread.join()
            if slot.worker is not None:
                slot.worker.stop(self.timeout_s)
                slot.worker = None

    def _submit(self, slot: _Slot, call: Call) -> concurrent.futures.Future:
        slot.calls.put(call)
        return call.future

    def _drain(self, slot: _Slot) -> list[Call]:
        """Takes the slot's queued calls (the lock is held); a shutdown marker stays queued."""
        calls, stop = [], False
        while True:
            try:
                call = slot.calls.get_nowait()
            except queue.Empty:
                break
            if call is None:
                stop = True
            else:
                calls.append(call)
        if stop:
            slot.calls.put(None)
        return calls

    def _relaunch(self, slot: _Slot, replacing: bool) -> bool:
        try:
            slot.worker = self._launch()
        except Exception as error:
            log.warning("could not start environment worker %d: %s", slot.index, error)
            slot.launch_error = error
            return False
        with self._lock:
            self._counters["workers_started"] += 1
            self._counters["workers_replaced"] += replacing
        return True

    def _serve(self, slot: _Slot) -> None:
        self._relaunch(slot, replacing=False)
        slot.launched.set()
        while (call := slot.calls.get()) is not None:
            if slot.worker is None and not self._relaunch(slot, replacing=True):
                self._lose_worker(slot, call, False, f"could not be started ({slot.launch_error})")
                continue
            try:
                with self.tracer.span("env", call.method, f"env worker {slot.index}"):
                    ok, value = slot.worker.call((call.method, call.args), self.timeout_s)
            except WorkerTimeout:
                self._lose_worker(slot, call, True, f"timed out after {self.timeout_s} s")
                continue
            except WorkerCrash as crash:
                self._lose_worker(slot, call, False, str(crash))
                continue
            except Exception as error:  # nothing was sent (the request would not serialise)
                ok, value = False, error
            self._record(call, ok)
            if call.future is not None:
                if ok:
                    call.future.set_result(value)
                else:
                    call.future.set_exception(value)

    def _record(self, call: Call, ok: bool) -> None:
        """Keeps what `_rerun` needs: a started episode's arguments, then each step it took; a
        start that failed leaves no episode."""
        with self._lock:
            if call.method == "start":
                slot = self._where.get(call.episode_id)
                if ok:
                    self._history[call.episode_id] = _History(call.args)
                elif slot is not None:
                    slot.episodes.discard(call.episode_id)
                    self._where.pop(call.episode_id, None)
            elif call.method == "step" and ok and call.episode_id in self._history:
                self._history[call.episode_id].steps.append(call.args[1])

    def _lose_worker(self, slot: _Slot, call: Call, timed_out: bool, reason: str) -> None:
        """Kills the worker, loses the episode whose call it was, starts a fresh worker and
        re-runs the worker's other episodes on it, then fails the lost episode's calls (so
        whoever sees the failure also sees the counters and the new worker)."""
        if slot.worker is not None:
            slot.worker.kill()
            slot.worker = None
        with self._lock:
            self._counters["worker_timeouts" if timed_out else "worker_crashes"] += 1
            failed = [call, *self._lose(slot, {call.episode_id})]
            survivors = sorted(slot.episodes)
            closed = self._closed
        message = f"environment worker {slot.index} {reason} during {call.method}"
        log.warning("%s: episode %s lost", message, call.episode_id)
        if not closed and self._relaunch(slot, replacing=True):
            self._rerun(slot, survivors)
        elif survivors:
            with self._lock:
                failed += self._lose(slot, set(survivors))
        fail_all(failed, f"{message}; its episode is lost")

    def _lose(self, slot: _Slot, episodes: set[str]) -> list[Call]:
        """Marks `episodes` of `slot` lost (the lock is held); returns their queued calls, the
        slot's other calls staying queued in order."""
        episodes &= slot.episodes
        slot.episodes -= episodes
        for episode_id in episodes:
            del self._where[episode_id]
            self._history.pop(episode_id, None)
        self._lost |= episodes
        self._counters["episodes_lost"] += len(episodes)
        queued = []
        while True:
            try:
                queued.append(slot.calls.get_nowait())
            except queue.Empty:
                break
        for item in queued:  # the rest, and a shutdown marker, go back in their order
            if item is None or item.episode_id not in episodes:
                slot.calls.put(item)
        return [c for c in queued if c is not None and c.episode_id in episodes]

    def _rerun(self, slot: _Slot, episodes: list[str]) -> None:
        """Rebuilds `episodes` on the slot's fresh worker by replaying their start and steps
        (their results are already delivered); if that fails too, they are lost."""
        for episode_id in episodes:
            with self._lock:
                history = self._history.get(episode_id)
            if history is None:  # its start is still queued: it begins on the new worker
                continue
            try:
                ok, _ = slot.worker.call(("start", history.start), self.timeout_s)
                for output in history.steps:
                    if ok:
                        ok, _ = slot.worker.call(("step", (episode_id, output)), self.timeout_s)
            except (WorkerTimeout, WorkerCrash) as error:
                slot.worker.kill()
                slot.worker = None
                with self._lock:
                    failed = self._lose(slot, set(episodes))
                log.warning("re-running episodes on worker %d failed: %s", slot.index, error)
                fail_all(failed, f"environment worker {slot.index} failed re-running episodes")
                return
            with self._lock:
                if ok:
                    self._counters["episodes_rerun"] += 1
                    continue
                failed = self._lose(slot, {episode_id})
            fail_all(failed, f"episode {episode_id!r} could not be re-run on a fresh worker")


class ProcessEnvironmentPool(WorkerPool):
    """Workers are child processes running `python -m composer_jax.envs.worker`."""

    def __init__(self, num_workers: int = 2, timeout_s: float | None = None):
        super().__init__(num_workers, timeout_s)

    def _launch(self) -> WorkerProcess:
        return WorkerProcess(self.timeout_s)

    def worker_pids(self) -> dict[int, int]:
        """Worker index -> pid of its current process."""
        workers = [(slot.index, slot.worker) for slot in self._slots]
        return {index: worker.pid for index, worker in workers if worker is not None}
