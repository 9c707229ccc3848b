"""The episode driver: the actor loop's side of one sample, scheduling only.

Per sample: start its environment (resumed from a snapshot after a restart), hand the workflow
(`composer_jax.agent.workflow`) the first observation, each finished turn and each environment
result, and do what it answers: queue its request until the sampler has a slot, continue or
restart the request (cache kept), run a turn in the environment (freeing the slot while the
environment grades a last turn), or score the sample. A sample whose environment worker fails
starts over (at most MAX_ATTEMPTS times). The coordinator owns the shared state
(`RolloutState`) and decides what happens when a group is complete.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable

from composer_jax.actor.env_workers import EnvironmentPool, EnvWorkerError
from composer_jax.actor.ids import GroupId
from composer_jax.actor.lifecycle import Counters, GroupSlot, Sample, SampleState
from composer_jax.actor.sampler import Sampler
from composer_jax.agent import Continue, Finish, Restart, Step, Submit, Workflow
from composer_jax.envs import EnvConfig
from composer_jax.infer import Completion

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # environment failures a sample survives before it is scored 0


@dataclasses.dataclass
class RolloutState:
    """What the rollout thread and the trainer loop share (under `lock`)."""

    groups: dict[GroupId, GroupSlot] = dataclasses.field(default_factory=dict)  # in flight
    active: list[Sample] = dataclasses.field(default_factory=list)  # not yet scored
    waiting: collections.deque = dataclasses.field(default_factory=collections.deque)  # for a slot
    by_request: dict[int, Sample] = dataclasses.field(default_factory=dict)  # in the sampler
    counters: Counters = dataclasses.field(default_factory=Counters)
    lock: threading.Condition = dataclasses.field(default_factory=threading.Condition)

    def needing_slots(self) -> int:
        """Samples that hold a sampler slot or will: all not yet scored but those whose last
        turn is in the environment (their slot was released, see `EpisodeDriver._act`)."""
        return sum(
            1
            for s in self.active
            if s.state is not SampleState.IN_ENV or s.request_id in self.by_request
        )


class EpisodeDriver:
    """Moves samples through SCHEDULED -> GENERATING <-> IN_ENV -> SCORED (rollout thread only);
    calls `on_scored(sample)` once a sample is scored."""

    def __init__(
        self,
        sampler: Sampler,
        env_pool: EnvironmentPool,
        workflow: Workflow,
        env_config: EnvConfig,
        state: RolloutState,
        on_scored: Callable[[Sample], None],
    ):
        self.sampler, self.env_pool, self.workflow = sampler, env_pool, workflow
        self.env_config, self.state, self.on_scored = env_config, state, on_scored

    def start(self, sample: Sample, snapshot: dict | None = None) -> None:
        """Starts the sample's environment (from an environment snapshot when `sample.episode`
        is a restored episode)."""
        sample.state = SampleState.SCHEDULED
        sample.pending = self.env_pool.start(
            sample.episode_id, sample.group.task, self.env_config, snapshot
        )
        self.state.active.append(sample)

    def resumable(self, sample: Sample) -> bool:
        """Waiting on the policy between two turns: what an in-flight record can resume."""
        return sample.state is SampleState.GENERATING and self.workflow.resumable(sample.episode)

    def feed_sampler(self) -> None:
        """Submits waiting samples while the sampler has free slots."""
        state = self.state
        free = self.sampler.num_slots - len(state.by_request)
        while free > 0 and state.waiting:
            sample = state.waiting.popleft()
            request, sample.next_request = sample.next_request, None
            sample.request_id = self.sampler.submit(request.tokens, request.params)
            state.by_request[sample.request_id] = sample
            sample.state = SampleState.GENERATING
            free -= 1

    def advance_env(self) -> bool:
        """Handles every environment future that completed; True if any did."""
        progressed = False
        for sample in list(self.state.active):
            future = sample.pending
            if future is None or not future.done():
                continue
            progressed = True
            sample.pending = None
            try:
                result = future.result()
            except Exception as e:  # noqa: BLE001 -- a worker crash or an environment's own error
                self.requeue(sample, e)
                continue
            if sample.state is SampleState.SCHEDULED:
                if sample.episode is None:
                    task = sample.group.task
                    sample.episode, action = self.workflow.begin(task, sample.episode_id, result)
                else:  # restored from an in-flight record
                    action = self.workflow.resume(sample.episode)
                self._act(sample, action)
            else:
                self._act(sample, self.workflow.on_result(sample.episode, result))
        return progressed

    def requeue(self, sample: Sample, error: Exception) -> None:
        """The sample's environment failed: free its slot and start it over, at most
        MAX_ATTEMPTS times (then it is scored 0 as truncated, so its group can finish)."""
        state = self.state
        with state.lock:
            state.counters.env_failures += 1
            if not isinstance(error, EnvWorkerError):
                state.counters.env_errors += 1
        if sample.attempt + 1 >= MAX_ATTEMPTS:
            log.warning("%s: %r; giving up (reward 0)", sample.episode_id, error)
            sample.episode = self.workflow.abandon(
                sample.episode, sample.group.task, sample.episode_id
            )
            self.finish(sample)
            return
        with state.lock:
            state.counters.samples_requeued += 1
        self._release(sample)
        state.active.remove(sample)
        self.env_pool.close(sample.episode_id)
        log.warning("%s: %r; re-queued", sample.episode_id, error)
        sample.reset()
        self.start(sample)

    def restart_all(self) -> None:
        """The sampler was lost with every request: start each active sample over."""
        state = self.state
        state.by_request.clear()
        state.waiting.clear()
        for sample in list(state.active):
            state.active.remove(sample)
            self.env_pool.close(sample.episode_id)
            with state.lock:
                state.counters.samples_requeued += 1
            sample.reset()
            self.start(sample)

    def on_completion(self, completion: Completion) -> None:
        sample = self.state.by_request.get(completion.request_id)
        if sample is not None:
            self._act(sample, self.workflow.on_completion(sample.episode, completion))

    def _act(self, sample: Sample, action) -> None:
        """Does what the workflow answered for the sample."""
        if isinstance(action, Submit):  # it waits for a slot (`feed_sampler`)
            sample.next_request = action
            self.state.waiting.append(sample)
        elif isinstance(action, Step):
            sample.state = SampleState.IN_ENV
            sample.pending = self.env_pool.step(sample.episode_id, action.text)
            if action.last:
                # The environment ends the episode at this step, so nothing will continue the
                # request: its cache slot takes the next sample while the turn runs and is
                # graded (about 100 ms on 2 cores, a third of a one-turn sample's time).
                self._release(sample)
        elif isinstance(action, (Continue, Restart)):
            by_request = self.state.by_request
            del by_request[sample.request_id]
            if isinstance(action, Continue):
                rid = self.sampler.continue_request(
                    sample.request_id, action.appended, action.params
                )
            else:
                rid = self.sampler.restart_request(
                    sample.request_id, action.keep, action.appended, action.params
                )
            sample.request_id = rid
            by_request[rid] = sample
            sample.state = SampleState.GENERATING
        elif isinstance(action, Finish):
            self.finish(sample)
        else:
            raise TypeError(f"the workflow answered {action!r}, not an action")

    def _release(self, sample: Sample) -> None:
        if sample.request_id in self.state.by_request:
            del self.state.by_request[sample.request_id]
            self.sampler.release(sample.request_id)

    def finish(self, sample: Sample) -> None:
        state = self.state
        self._release(sample)
        self.env_pool.close(sample.episode_id)
        state.active.remove(sample)
        sample.outcome = outcome = self.workflow.outcome(sample.episode)
        sample.state = SampleState.SCORED
        with state.lock:
            counters = state.counters
            counters.samples_finished += 1
            counters.turns += outcome.num_turns
            counters.truncated += int(outcome.truncated)
            counters.summaries += outcome.summaries
            counters.feedback.update(outcome.feedback)
            if outcome.flagged:
                counters.flagged_samples += 1
                counters.monitor_flags.update({flag.kind for flag in outcome.flags})
        self.on_scored(sample)
