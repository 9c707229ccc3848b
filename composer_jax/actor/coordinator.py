"""The coordinator of asynchronous RL: moves samples through their lifecycle between the roles.

    scheduled -> generating <-> in environment -> scored -> grouped (ledger) -> trained

A rollout thread drives the sampler and the environment pool: the `Scheduler` says which group
of `group_size` samples of one prompt comes next (and when staleness allows it), the
`EpisodeDriver` takes each sample through its turns, and when every sample of a group is scored
the group is persisted in the `GroupLedger`. Groups are started while their samples fit the
samplers' slots plus `schedule_ahead_groups` groups: those wait in the queue with their
environments already started, so a slot that frees is refilled at once. The trainer loop (the
caller's thread) takes finished groups as they come (`scheduler.next_groups`), trains, and
publishes the new weights, which the sampler picks up between two decode steps. At each
checkpoint the groups in flight are saved (`save_in_flight`, see `composer_jax.actor.inflight`),
and a restart resumes them mid-episode.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future

from composer_jax.actor import inflight
from composer_jax.actor.env_workers import EnvironmentPool
from composer_jax.actor.episodes import EpisodeDriver, RolloutState
from composer_jax.actor.ids import GroupId
from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.lifecycle import GroupSlot, Sample, SampleState
from composer_jax.actor.ray_backend import SamplerLostError
from composer_jax.actor.sampler import Sampler
from composer_jax.actor.samples import make_group
from composer_jax.actor.scheduler import Scheduler, Variant
from composer_jax.agent import Workflow
from composer_jax.config import RLConfig
from composer_jax.envs import EnvConfig, Task
from composer_jax.trace import NULL_TRACER, SAMPLER

log = logging.getLogger(__name__)

SYNC_INTERVAL_S = 0.1


class RolloutFailedError(RuntimeError):
    """The rollout thread stopped on an error that is not an environment worker's failure."""


class Coordinator:
    """Runs rollouts in a background thread and hands finished groups to the trainer loop."""

    def __init__(
        self,
        cfg: RLConfig,
        sampler: Sampler,
        env_pool: EnvironmentPool,
        ledger: GroupLedger,
        prompts: list[tuple[str, Task]],
        workflow: Workflow,
        env_config: EnvConfig,
        seed: int = 0,
        resume: list[inflight.GroupState] = (),
        inflight_store: inflight.InFlightStore | None = None,
        variant: Variant | None = None,
        tracer=NULL_TRACER,
    ):
        self.tracer = tracer  # the rollout thread's track is the sampler's
        self.cfg, self.sampler, self.env_pool, self.ledger = cfg, sampler, env_pool, ledger
        self.state = RolloutState()
        self.scheduler = Scheduler(cfg, prompts, ledger, seed, variant)
        self.driver = EpisodeDriver(
            sampler, env_pool, workflow, env_config, self.state, on_scored=self._on_scored
        )
        self.saver = inflight.InFlightSaver(inflight_store, env_pool, self.driver.resumable)
        self._resume = []
        for saved in resume:
            group = GroupId.parse(saved.group_id)
            if inflight.valid_for(saved, cfg.rollout.group_size) and self.scheduler.is_queued(
                group
            ):
                self.scheduler.take(group)
                self._resume.append(saved)
        self.sampler_stats: dict[str, float] = {}  # refreshed by the rollout thread only
        self._last_sync = 0.0
        # Groups scheduled (resumed ones included) or finished, not yet trained.
        self._untrained = len(ledger.pending()) + len(self._resume)
        self.trainer_version = 0
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.first_token_time: float | None = None

    # ----------------------------------------------------------------- trainer-facing API

    @property
    def counters(self):
        return self.state.counters

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the rollout thread; re-raises its failure, if it had one."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for sample in list(self.state.active):
            self.env_pool.close(sample.episode_id)
        self.saver.fail_all("the coordinator stopped before saving")
        if self._error is not None:
            raise RolloutFailedError("the rollout thread failed") from self._error

    @property
    def exhausted(self) -> bool:
        """No prompt left to schedule and nothing in flight."""
        with self.state.lock:
            return self._nothing_left()

    def _nothing_left(self) -> bool:
        """Under the lock: no prompt to schedule, no group in flight or still to resume (the
        rollout thread rebuilds those after `start`; until then the epoch is not over)."""
        return not self.scheduler.queued and not self.state.groups and not self._resume

    def wait_for_groups(
        self, count: int, timeout_s: float | None = None, interrupted=None
    ) -> list[str] | None:
        """Blocks until `count` groups are pending in the ledger (fewer once the epoch is over);
        re-raises a failure of the rollout thread. `interrupted()` is polled while waiting (it
        may raise); once it returns True the wait ends with None."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        lock = self.state.lock
        with lock:
            while True:
                if self._error is not None:
                    raise RolloutFailedError("the rollout thread failed") from self._error
                if interrupted is not None and interrupted():
                    return None
                pending = self.ledger.pending()
                if len(pending) >= count or self._nothing_left():
                    return pending[:count]
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{count} groups not ready in {timeout_s} s")
                lock.wait(timeout=0.5 if remaining is None else min(remaining, 0.5))

    def redispatch(self, group_ids: list[str]) -> None:
        """Schedules the prompts of dropped groups again (first in line), so the epoch still
        covers every prompt."""
        with self.state.lock:
            self.scheduler.redispatch(group_ids)
            self.state.lock.notify_all()

    def save_in_flight(self, step: int) -> Future:
        """Asks the rollout thread to save the groups in flight as of trainer step `step` (see
        `composer_jax.actor.inflight`); the future gives how many samples were saved mid-episode."""
        with self.state.lock:
            failed = self._error is not None
        if failed:
            future: Future = Future()
            future.set_exception(RolloutFailedError("the rollout thread failed"))
            return future
        return self.saver.request(step)

    def groups_trained(self, count: int, new_version: int) -> None:
        """The trainer consumed (or dropped) `count` groups and now holds `new_version`."""
        with self.state.lock:
            self._untrained -= count
            self.trainer_version = new_version
            self.state.lock.notify_all()

    def snapshot(self) -> dict[str, float]:
        """Counters for the metrics line."""
        state = self.state
        with state.lock:
            states = collections.Counter(s.state for s in state.active)
            out = {
                **state.counters.metrics(),
                "samples_generating": states[SampleState.GENERATING] + len(state.waiting),
                "samples_in_env": states[SampleState.IN_ENV],
                "sampler_version": self.sampler.version or 0,
                "revisited_prompts": self.scheduler.revisits,
            }
        out.update({f"env/{k}": v for k, v in self.env_pool.health().items()})
        return out

    # ----------------------------------------------------------------- rollout thread

    def _run(self) -> None:
        tracer = self.tracer
        tracer.name_thread(SAMPLER)
        idle_since = None  # tracing: start of the iterations that found nothing to do
        try:
            self._resume_groups()
            while not self._stop.is_set():
                start = time.perf_counter() if tracer.enabled else 0.0
                try:
                    self.saver.serve(list(self.state.groups.values()))
                    self._sync_weights()
                    self._schedule()
                    self.driver.feed_sampler()
                    progressed = self.driver.advance_env()
                    polled = bool(self.state.by_request)
                    if tracer.enabled and progressed:
                        tracer.complete("rollout_host", "env results", start, time.perf_counter())
                    finished = self.sampler.poll() if polled else []
                    if finished:
                        with tracer.span("rollout_host", "turns", turns=len(finished)):
                            for completion in finished:
                                if self.first_token_time is None:
                                    self.first_token_time = time.monotonic()
                                self.driver.on_completion(completion)
                except SamplerLostError as e:
                    log.warning("%s; re-queuing %d samples", e, len(self.state.active))
                    with self.state.lock:
                        self.state.counters.sampler_failures += 1
                    self.driver.restart_all()
                    continue
                if tracer.enabled:  # one idle event per run of empty iterations
                    if polled or progressed:
                        if idle_since is not None:
                            tracer.complete("idle", "nothing to decode", idle_since, start)
                        idle_since = None
                    elif idle_since is None:
                        idle_since = start
                if not finished and not progressed:
                    with self.state.lock:
                        idle = not self.state.groups and not self.scheduler.queued
                    time.sleep(0.05 if idle else 0.002)
            if idle_since is not None:
                tracer.complete("idle", "nothing to decode", idle_since, time.perf_counter())
        except BaseException as e:  # noqa: BLE001 -- surfaced to the trainer loop
            log.exception("the rollout thread failed")
            with self.state.lock:
                self._error = e
                self.state.lock.notify_all()
            self.saver.fail_all("the rollout thread failed")

    def _resume_groups(self) -> None:
        """Rebuilds the groups saved in flight: scored samples as they were, samples between two
        turns from their environment snapshot, the others from scratch."""
        while self._resume:  # each leaves the list as it enters the groups in flight
            saved = self._resume[0]
            task = self.scheduler.task(GroupId.parse(saved.group_id))
            group, to_start = inflight.restore_group(
                saved, task, self.cfg.rollout.group_size, self.trainer_version
            )
            with self.state.lock:
                self.state.groups[group.group_id] = group
                self._resume.pop(0)
                self.state.counters.groups_scheduled += 1
            for sample, snapshot in to_start:
                self.driver.start(sample, snapshot)
                if snapshot is not None:
                    with self.state.lock:
                        self.state.counters.samples_resumed += 1
            if group.scored:
                self._finish_group(group)

    def _sync_weights(self) -> None:
        """Pulls new weights and refreshes the sampler's stats, at most every SYNC_INTERVAL_S
        (a listing of the store may be a remote call)."""
        now = time.monotonic()
        if now - self._last_sync < SYNC_INTERVAL_S:
            return
        self._last_sync = now
        before = self.sampler.version
        after = self.sampler.sync_weights()
        if after != before and self.state.by_request:
            self.state.counters.weight_updates_in_flight += 1
        self.sampler_stats = self.sampler.stats()

    def _schedule(self) -> None:
        cfg, state = self.cfg, self.state
        # Samples that hold or await a slot count against the slots plus the lookahead (a
        # sample's slot is free again once its last turn leaves the sampler, even while the
        # turn is graded and the rest of its group still generates).
        capacity = (
            cfg.rollout.num_slots * cfg.rollout.num_samplers
            + cfg.rollout.group_size * cfg.rollout.schedule_ahead_groups
        )
        with state.lock:
            while True:
                if state.needing_slots() + cfg.rollout.group_size > capacity:
                    return
                version = self.sampler.version or 0
                if not self.scheduler.admits(self.trainer_version, self._untrained, version):
                    return
                group_id = self.scheduler.next_group()
                if group_id is None:
                    return
                group = GroupSlot.fresh(
                    group_id, self.scheduler.task(group_id), cfg.rollout.group_size, version
                )
                state.groups[group_id] = group
                self._untrained += 1
                state.counters.groups_scheduled += 1
                for sample in group.samples:
                    self.driver.start(sample)

    def _on_scored(self, sample: Sample) -> None:
        if sample.group.scored:
            self._finish_group(sample.group)

    def _finish_group(self, group: GroupSlot) -> None:
        results = [s.outcome for s in group.samples]
        record = make_group(str(group.group_id), group.task.task_id, results)
        if record.policy_versions.size == 0:  # every sample gave up before its first token
            log.warning(
                "group %s: no sample generated a token (its environments never started); "
                "nothing to train, skipped",
                group.group_id,
            )
            with self.state.lock:
                del self.state.groups[group.group_id]
                self._untrained -= 1
                self.state.counters.groups_without_tokens += 1
                self.state.lock.notify_all()
            return
        self.ledger.add(record)
        with self.state.lock:
            del self.state.groups[group.group_id]
            self.state.counters.groups_finished += 1
            measured = [r.reward for r in results if not r.abandoned]
            self.state.counters.reward_sum += float(sum(measured))
            self.state.counters.reward_samples += len(measured)
            self.state.counters.samples_abandoned += len(results) - len(measured)
            self.scheduler.finished(
                group.group_id,
                max(r.num_turns for r in results),
                max(r.thinking_tokens for r in results),
            )
            self.state.lock.notify_all()
