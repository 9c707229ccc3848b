"""Environment worker pools for the asynchronous actor loop: episodes by id, calls as futures.

An episode stays on the worker that started it (its workspace lives there). When a worker dies
or a call runs past `timeout_s`, the worker is killed and replaced, every episode it held is lost
(their futures fail with `EnvWorkerError`, later steps fail at once) and the pool carries on;
`health()` counts what happened. Workers are child processes (`ProcessEnvironmentPool`), threads
of this process (`ThreadEnvironmentPool`: no isolation, for small hosts and tests) or Ray actors
(`RayEnvironmentPool`). The worker side is `composer_jax.envs.worker`, which never imports JAX;
the parent's end of a worker process is `composer_jax.actor.worker_process`.
"""

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time

from composer_jax.actor.worker_process import WorkerCrash, WorkerProcess, WorkerTimeout
from composer_jax.envs import worker as env_worker
from composer_jax.envs.environment import EnvConfig
from composer_jax.envs.task import Task

log = logging.getLogger(__name__)

HEALTH_KEYS = (
    "workers_started",
    "worker_crashes",
    "worker_timeouts",
    "workers_replaced",
    "episodes_lost",
    "calls",
)
POOL_KINDS = ("process", "thread", "ray")


class EnvWorkerError(RuntimeError):
    """The worker running an episode crashed or timed out: the episode is lost."""


@dataclasses.dataclass(eq=False)
class _Call:
    episode_id: str
    method: str
    args: tuple
    future: concurrent.futures.Future | None


def _running_future() -> concurrent.futures.Future:
    """A future the caller cannot cancel, so the pool completes each one exactly once."""
    future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    return future


def _failed(error: Exception) -> concurrent.futures.Future:
    future = _running_future()
    future.set_exception(error)
    return future


def _lost_error(episode_id: str) -> EnvWorkerError:
    return EnvWorkerError(f"episode {episode_id!r} was lost with its worker")


def _fail_all(calls: list[_Call], message: str) -> None:
    for call in calls:
        if call.future is not None:
            call.future.set_exception(EnvWorkerError(message))


class EnvironmentPool:
    """What the actor loop drives. Futures are completed outside the pool's lock, so their
    callbacks may call the pool."""

    def __init__(self, timeout_s: float):
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


class _WorkerPool(EnvironmentPool):
    """Episodes pinned to long-lived workers (the least loaded at start); one I/O thread per
    worker serialises its calls, calls to different workers run in parallel. Subclasses say how
    to launch a worker: a handle with `call(request, timeout_s)` (raising `WorkerCrash` or
    `WorkerTimeout`), `kill()` and `stop(timeout_s)`."""

    def __init__(self, num_workers: int, timeout_s: float):
        super().__init__(timeout_s)
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self._slots = [_Slot(index) for index in range(num_workers)]
        self._where: dict[str, _Slot] = {}
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
                f"could not start environment worker(s) {[slot.index for slot in failed]}"
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
                return _failed(ValueError(f"episode {episode_id!r} already started"))
            slot = min(self._slots, key=lambda slot: len(slot.episodes))
            slot.episodes.add(episode_id)
            self._where[episode_id] = slot
            return self._submit(slot, _Call(episode_id, "start", args, _running_future()))

    def step(self, episode_id: str, model_output: str) -> concurrent.futures.Future:
        with self._lock:
            self._check_open()
            self._counters["calls"] += 1
            if episode_id in self._lost:
                return _failed(_lost_error(episode_id))
            slot = self._where.get(episode_id)
            if slot is None:
                return _failed(KeyError(f"unknown episode {episode_id!r}"))
            call = _Call(episode_id, "step", (episode_id, model_output), _running_future())
            return self._submit(slot, call)

    def snapshot(self, episode_id: str) -> concurrent.futures.Future:
        with self._lock:
            self._check_open()
            if episode_id in self._lost:
                return _failed(_lost_error(episode_id))
            slot = self._where.get(episode_id)
            if slot is None:
                return _failed(KeyError(f"unknown episode {episode_id!r}"))
            return self._submit(
                slot, _Call(episode_id, "snapshot", (episode_id,), _running_future())
            )

    def close(self, episode_id: str) -> None:
        with self._lock:
            self._lost.discard(episode_id)
            slot = self._where.pop(episode_id, None)
            if slot is not None:
                slot.episodes.discard(episode_id)
                if not self._closed:
                    slot.calls.put(_Call(episode_id, "close", (episode_id,), None))

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
            for slot in self._slots:
                slot.episodes.clear()
                slot.calls.put(None)
        _fail_all(pending, "the environment pool was shut down")
        for slot in self._slots:
            slot.thread.join()
            if slot.worker is not None:
                slot.worker.stop(self.timeout_s)
                slot.worker = None

    def _submit(self, slot: _Slot, call: _Call) -> concurrent.futures.Future:
        slot.calls.put(call)
        return call.future

    def _drain(self, slot: _Slot) -> list[_Call]:
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
                ok, value = slot.worker.call((call.method, call.args), self.timeout_s)
            except WorkerTimeout:
                self._lose_worker(slot, call, True, f"timed out after {self.timeout_s} s")
                continue
            except WorkerCrash as crash:
                self._lose_worker(slot, call, False, str(crash))
                continue
            except Exception as error:  # nothing was sent (the request would not serialise)
                ok, value = False, error
            if not ok and call.method == "start":
                with self._lock:
                    slot.episodes.discard(call.episode_id)
                    self._where.pop(call.episode_id, None)
            if call.future is not None:
                if ok:
                    call.future.set_result(value)
                else:
                    call.future.set_exception(value)

    def _lose_worker(self, slot: _Slot, call: _Call, timed_out: bool, reason: str) -> None:
        """Kills the worker, loses its episodes, starts a fresh worker, then fails the calls
        (so whoever sees the failure also sees the counters and the new worker)."""
        if slot.worker is not None:
            slot.worker.kill()
            slot.worker = None
        with self._lock:
            lost, slot.episodes = slot.episodes, set()
            for episode_id in lost:
                del self._where[episode_id]
            self._lost |= lost
            self._counters["worker_timeouts" if timed_out else "worker_crashes"] += 1
            self._counters["episodes_lost"] += len(lost)
            failed = [call, *self._drain(slot)]
            closed = self._closed
        message = f"environment worker {slot.index} {reason} during {call.method}"
        log.warning("%s: %d episode(s) lost", message, len(lost))
        if not closed:
            self._relaunch(slot, replacing=True)
        _fail_all(failed, f"{message}; its episodes are lost")


class ProcessEnvironmentPool(_WorkerPool):
    """Workers are child processes running `python -m composer_jax.envs.worker`."""

    def __init__(self, num_workers: int = 2, timeout_s: float = 60.0):
        super().__init__(num_workers, timeout_s)

    def _launch(self) -> WorkerProcess:
        return WorkerProcess(self.timeout_s)

    def worker_pids(self) -> dict[int, int]:
        """Worker index -> pid of its current process."""
        workers = [(slot.index, slot.worker) for slot in self._slots]
        return {index: worker.pid for index, worker in workers if worker is not None}


class _RayWorker:
    """A Ray actor holding an `EpisodeHost`."""

    def __init__(self, ray, actor_class, timeout_s: float):
        self._ray = ray
        self.actor = actor_class.remote()
        try:
            self._get(self.actor.pid.remote(), timeout_s)
        except BaseException:
            self.kill()
            raise

    def call(self, request: tuple, timeout_s: float):
        return self._get(self.actor.handle.remote(*request), timeout_s)

    def _get(self, ref, timeout_s: float):
        ready, _ = self._ray.wait([ref], timeout=timeout_s)
        if not ready:
            raise WorkerTimeout()
        try:
            return self._ray.get(ref)
        except self._ray.exceptions.RayError as error:
            raise WorkerCrash(f"(actor) died: {type(error).__name__}") from error

    def kill(self) -> None:
        self._ray.kill(self.actor, no_restart=True)

    def stop(self, timeout_s: float) -> None:
        try:
            self.call(("close_all", ()), timeout_s)
        except (WorkerCrash, WorkerTimeout):
            pass
        self.kill()


class RayEnvironmentPool(_WorkerPool):
    """Workers are Ray actors; the caller runs `ray.init`. `actor_options` go to `.options()`
    (e.g. resources that place environments on CPU hosts)."""

    def __init__(
        self, num_workers: int = 2, timeout_s: float = 60.0, actor_options: dict | None = None
    ):
        try:
            import ray
        except ImportError as error:
            raise ImportError(
                "RayEnvironmentPool needs ray: pip install 'composer-jax[ray]'"
            ) from error
        self._ray = ray
        self._actor_class = ray.remote(env_worker.EpisodeHost).options(**(actor_options or {}))
        super().__init__(num_workers, timeout_s)

    def _launch(self) -> _RayWorker:
        return _RayWorker(self._ray, self._actor_class, self.timeout_s)

    def actors(self) -> dict:
        """Worker index -> its current actor handle."""
        workers = [(slot.index, slot.worker) for slot in self._slots]
        return {index: worker.actor for index, worker in workers if worker is not None}


class ThreadEnvironmentPool(EnvironmentPool):
    """Episodes in this process on a pool of threads (like `envs.EpisodePool`). A call past
    `timeout_s` cannot be stopped: its thread is abandoned (a fresh one takes its place, the
    abandoned one frees the episode if it ever returns) and its episode is lost."""

    def __init__(self, max_workers: int = 8, timeout_s: float = 60.0):
        super().__init__(timeout_s)
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._host = env_worker.EpisodeHost()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._running: dict[_Call, tuple[float, threading.Thread]] = {}
        self._threads: set[threading.Thread] = set()
        self._wakeup = threading.Condition(self._lock)
        with self._lock:
            for _ in range(max_workers):
                self._add_thread()
        self._watchdog = threading.Thread(target=self._watch, name="env-watchdog", daemon=True)
        self._watchdog.start()

    def start(
        self,
        episode_id: str,
        task: Task,
        config: EnvConfig = EnvConfig(),
        snapshot: dict | None = None,
    ) -> concurrent.futures.Future:
        with self._lock:
            self._check_open()
            self._counters["calls"] += 1
            if episode_id in self._lost:
                return _failed(ValueError(f"episode {episode_id!r} already started"))
        return self._submit(_Call(episode_id, "start", (episode_id, task, config, snapshot), None))

    def step(self, episode_id: str, model_output: str) -> concurrent.futures.Future:
        with self._lock:
            self._check_open()
            self._counters["calls"] += 1
            if episode_id in self._lost:
                return _failed(_lost_error(episode_id))
        return self._submit(_Call(episode_id, "step", (episode_id, model_output), None))

    def snapshot(self, episode_id: str) -> concurrent.futures.Future:
        with self._lock:
            self._check_open()
            if episode_id in self._lost:
                return _failed(_lost_error(episode_id))
        return self._submit(_Call(episode_id, "snapshot", (episode_id,), None))

    def close(self, episode_id: str) -> None:
        with self._lock:
            if episode_id in self._lost:
                self._lost.discard(episode_id)
                return
            if not self._closed:
                self._calls.put(_Call(episode_id, "close", (episode_id,), None))

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = []
            while True:
                try:
                    pending.append(self._calls.get_nowait())
                except queue.Empty:
                    break
            threads = list(self._threads)
            for _ in threads:
                self._calls.put(None)
            self._wakeup.notify_all()
        _fail_all(pending, "the environment pool was shut down")
        deadline = time.monotonic() + self.timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            hung, self._running = list(self._running), {}
        _fail_all(hung, "the environment pool was shut down")
        self._host.close_all()

    def _submit(self, call: _Call) -> concurrent.futures.Future:
        call.future = _running_future()
        self._calls.put(call)
        return call.future

    def _add_thread(self) -> None:
        """Starts one more runner (the lock is held)."""
        thread = threading.Thread(target=self._serve, name="env-thread", daemon=True)
        self._threads.add(thread)
        self._counters["workers_started"] += 1
        thread.start()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            with self._lock:
                lost = call.episode_id in self._lost
                if not lost:
                    deadline = time.monotonic() + self.timeout_s
                    self._running[call] = (deadline, threading.current_thread())
                    self._wakeup.notify()
            if lost:
                if call.future is not None:
                    call.future.set_exception(_lost_error(call.episode_id))
                continue
            try:
                value, error = getattr(self._host, call.method)(*call.args), None
            except Exception as failure:
                value, error = None, failure
            with self._lock:
                abandoned = self._running.pop(call, None) is None
            if abandoned:
                if call.method != "close":
                    self._host.close(call.episode_id)
                return
            if call.future is None:
                continue
            if error is None:
                call.future.set_result(value)
            else:
                call.future.set_exception(error)

    def _watch(self) -> None:
        """Fails calls past their deadline; their threads are replaced."""
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                expired = [call for call, (end, _) in self._running.items() if end <= now]
                for call in expired:
                    _, thread = self._running.pop(call)
                    self._threads.discard(thread)
                    self._counters["worker_timeouts"] += 1
                    self._counters["workers_replaced"] += 1
                    if call.method != "close" and call.episode_id not in self._lost:
                        self._lost.add(call.episode_id)
                        self._counters["episodes_lost"] += 1
                    self._add_thread()
                if not expired:
                    deadlines = [end for end, _ in self._running.values()]
                    wait = max(0.0, min(deadlines) - now) if deadlines else None
                    self._wakeup.wait(wait)
                    continue
            for call in expired:
                log.warning("environment call %s timed out after %s s", call.method, self.timeout_s)
            _fail_all(expired, f"the environment call timed out after {self.timeout_s} s")


def make_environment_pool(kind: str, num_workers: int, timeout_s: float) -> EnvironmentPool:
    """A pool of `kind` ("process", "thread" or "ray")."""
    if kind == "process":
        return ProcessEnvironmentPool(num_workers, timeout_s)
    if kind == "thread":
        return ThreadEnvironmentPool(num_workers, timeout_s)
    if kind == "ray":
        return RayEnvironmentPool(num_workers, timeout_s)
    raise ValueError(f"environment pool kind must be one of {POOL_KINDS}, got {kind!r}")
