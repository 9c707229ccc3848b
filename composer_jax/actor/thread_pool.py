"""Environment workers as threads of this process: no separate worker to lose, for small hosts
and tests (the episodes' commands still run in their sandboxes)."""

import collections
import concurrent.futures
import logging
import queue
import threading
import time

from composer_jax.actor.env_workers import (
    Call,
    EnvironmentPool,
    fail_all,
    failed_future,
    lost_error,
    running_future,
)
from composer_jax.envs import worker as env_worker
from composer_jax.envs.environment import EnvConfig
from composer_jax.envs.grading.task import Task

log = logging.getLogger(__name__)


class ThreadEnvironmentPool(EnvironmentPool):
    """Episodes in this process on a pool of threads (like `envs.EpisodePool`). A call past
    `timeout_s` cannot be stopped: its thread is abandoned (a fresh one takes its place, the
    abandoned one frees the episode if it ever returns) and its episode is lost.

    An episode's calls run one at a time in the order they were made, as on a worker process:
    a snapshot asked for before a step must not see that step (an in-flight save taken while
    the next turn was already applied would replay the turn on resume)."""

    def __init__(self, max_workers: int = 8, timeout_s: float | None = None):
        super().__init__(timeout_s)
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._host = env_worker.EpisodeHost()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        # Per episode with a call queued or running: the calls made after it, waiting their turn.
        self._behind: dict[str, collections.deque[Call]] = {}
        self._running: dict[Call, tuple[float, threading.Thread]] = {}
        self._threads: set[threading.Thread] = set()
        self._wakeup = threading.Condition(self._lock)
        with self._lock:
            for _ in range(max_workers):
                self._add_thread()
        self._watchdog = threading.Thread(target=self._watch, name="env-watchdog", daemon=True)
        self._watchdog.start()

    # Each call is checked and queued under one hold of the lock: a shutdown between the two
    # would leave it queued behind the threads' stop markers, its future never completed.
    def start(
        self,
        episode_id: str,
        task: Task,
        config: EnvConfig = EnvConfig(),
        snapshot: dict | None = None,
    ) -> concurrent.futures.Future:
        call = Call(episode_id, "start", (episode_id, task, config, snapshot), running_future())
        with self._lock:
            self._check_open()
            self._counters["calls"] += 1
            if episode_id in self._lost:
                return failed_future(ValueError(f"episode {episode_id!r} already started"))
            self._enqueue(call)
        return call.future

    def step(self, episode_id: str, model_output: str) -> concurrent.futures.Future:
        call = Call(episode_id, "step", (episode_id, model_output), running_future())
        with self._lock:
            self._check_open()
            self._counters["calls"] += 1
            if episode_id in self._lost:
                return failed_future(lost_error(episode_id))
            self._enqueue(call)
        return call.future

    def snapshot(self, episode_id: str) -> concurrent.futures.Future:
        call = Call(episode_id, "snapshot", (episode_id,), running_future())
        with self._lock:
            self._check_open()
            if episode_id in self._lost:
                return failed_future(lost_error(episode_id))
            self._enqueue(call)
        return call.future

    def close(self, episode_id: str) -> None:
        with self._lock:
            if episode_id in self._lost:
                self._lost.discard(episode_id)
                return
            if not self._closed:
                self._enqueue(Call(episode_id, "close", (episode_id,), None))

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = [call for waiting in self._behind.values() for call in waiting]
            self._behind.clear()
            while True:
                try:
                    pending.append(self._calls.get_nowait())
                except queue.Empty:
                    break
            threads = list(self._threads)
            for _ in threads:
                self._calls.put(None)
            self._wakeup.notify_all()
        fail_all(pending, "the environment pool was shut down")
        deadline = time.monotonic() + self.timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            hung, self._running = list(self._running), {}
        fail_all(hung, "the environment pool was shut down")
        self._host.close_all()

    def _enqueue(self, call: Call) -> None:
        """Queues `call` for a thread, or behind its episode's earlier call (the lock is held)."""
        waiting = self._behind.get(call.episode_id)
        if waiting is not None:
            waiting.append(call)
            return
        self._behind[call.episode_id] = collections.deque()
        self._calls.put(call)

    def _next_of(self, episode_id: str) -> None:
        """The episode's call is over: its next one, if any, goes to the threads (lock held)."""
        waiting = self._behind.get(episode_id)
        if waiting:
            self._calls.put(waiting.popleft())
        else:
            self._behind.pop(episode_id, None)

    def _add_thread(self) -> None:
        """Starts one more runner (the lock is held)."""
        name = f"env thread {self._counters['workers_started']}"  # its own trace track
        thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._threads.add(thread)
        self._counters["workers_started"] += 1
        thread.start()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            with self._lock:
                lost = call.episode_id in self._lost
                if lost:
                    self._next_of(call.episode_id)
                else:
                    deadline = time.monotonic() + self.timeout_s
                    self._running[call] = (deadline, threading.current_thread())
                    self._wakeup.notify()
            if lost:
                if call.future is not None:
                    call.future.set_exception(lost_error(call.episode_id))
                continue
            try:
                with self.tracer.span("env", call.method):
                    value, error = getattr(self._host, call.method)(*call.args), None
            except Exception as failure:
                value, error = None, failure
            with self._lock:
                abandoned = self._running.pop(call, None) is None
                if not abandoned:
                    self._next_of(call.episode_id)
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
                    self._next_of(call.episode_id)  # its later calls fail as lost
                    self._add_thread()
                if not expired:
                    deadlines = [end for end, _ in self._running.values()]
                    wait = max(0.0, min(deadlines) - now) if deadlines else None
                    self._wakeup.wait(wait)
                    continue
            for call in expired:
                log.warning("environment call %s timed out after %s s", call.method, self.timeout_s)
            fail_all(expired, f"the environment call timed out after {self.timeout_s} s")
