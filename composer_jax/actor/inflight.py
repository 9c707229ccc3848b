"""Rollouts in flight, saved with each checkpoint so that a restart resumes them mid-episode.

At a checkpoint the coordinator records every group still in flight: its scored samples' outcomes,
and each sample that waits on the policy between two turns as its workflow episode (token buffers,
turns, feedback: plain data) plus a snapshot of its environment (`Episode.snapshot`: workspace
files, counts, call log, todo list). A restart from that checkpoint rebuilds those samples: the
environment is restored, the workflow resumes the episode (its buffer is prefilled again, keeping
the routes the sampler used for it) and generation goes on with the next turn. Samples caught
anywhere else (on their first turn, inside the environment, summarising) start over, as do samples
whose tokens come from a policy version the restored trainer never had.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import threading
from collections.abc import Iterable
from concurrent.futures import Future

from composer_jax.actor import durable
from composer_jax.actor.ids import GroupId
from composer_jax.actor.lifecycle import GroupSlot, SampleState

FORMAT = 3  # 3: the workflow's episode state, or the scored sample's outcome


class InFlightError(RuntimeError):
    """An in-flight record that cannot be read."""


@dataclasses.dataclass
class SavedSample:
    index: int
    attempt: int
    scored: bool
    state: object  # an EpisodeOutcome once scored, else the workflow's episode state
    env_snapshot: dict | None = None  # None once scored

    @property
    def newest_version(self) -> int:
        sequences = self.state.sequences
        versions = [] if self.scored else list(self.state.versions)
        versions += [int(seq.policy_versions.max(initial=0)) for seq in sequences]
        return max(versions, default=0)


@dataclasses.dataclass
class GroupState:
    group_id: str
    scheduled_at_version: int
    samples: list[SavedSample]  # the samples that are kept; the others start over


def capture(sample, scored: bool) -> SavedSample:
    """A copy of `sample`'s outcome or episode state (the live sample goes on changing)."""
    state = sample.outcome if scored else copy.deepcopy(sample.episode)
    return SavedSample(sample.index, sample.attempt, scored, state)


def restore_group(
    saved: GroupState, task, group_size: int, trainer_version: int
) -> tuple[GroupSlot, list[tuple[object, dict | None]]]:
    """A group rebuilt from its record, and the samples whose episodes must start: (sample,
    environment snapshot) to resume between two turns (its `episode` restored), (sample, None)
    to start over. Samples with tokens of a version the restored trainer never had start over."""
    group = GroupSlot.fresh(
        GroupId.parse(saved.group_id), task, group_size, saved.scheduled_at_version
    )
    kept = {s.index: s for s in saved.samples if s.newest_version <= trainer_version}
    to_start = []
    for sample in group.samples:
        state = kept.get(sample.index)
        if state is None:
            to_start.append((sample, None))
            continue
        sample.attempt = state.attempt
        if state.scored:
            sample.outcome, sample.state = state.state, SampleState.SCORED
            continue
        sample.episode = state.state
        to_start.append((sample, state.env_snapshot))
    return group, to_start


def valid_for(saved: GroupState, group_size: int) -> bool:
    """Whether a record fits a group of `group_size` samples (each index once)."""
    indices = [s.index for s in saved.samples]
    return all(i < group_size for i in indices) and len(set(indices)) == len(indices)


class InFlightSaver:
    """Requests from the trainer loop (`request(step)`), served by the rollout thread (`serve`):
    copies of the groups in flight go to the store once the environment snapshots of the
    samples waiting between two turns have arrived."""

    def __init__(self, store: InFlightStore | None, env_pool, resumable):
        self.store, self.env_pool = store, env_pool
        self.resumable = resumable  # sample -> whether it waits on the policy between turns
        self._lock = threading.Lock()
        self._requests: list[tuple[int, Future]] = []
        self._pending = None  # (step, future, groups, [(saved sample, snapshot future)])

    def request(self, step: int) -> Future:
        """A future of how many samples were saved mid-episode at trainer step `step`."""
        future: Future = Future()
        if self.store is None:
            future.set_result(0)
            return future
        with self._lock:
            self._requests.append((step, future))
        return future

    def serve(self, groups: Iterable[GroupSlot]) -> None:
        """Starts the oldest request's capture, or completes the capture under way."""
        if self._pending is None:
            with self._lock:
                if not self._requests:
                    return
                step, future = self._requests.pop(0)
            self._pending = (step, future, *self._capture(groups))
            return
        step, future, states, waits = self._pending
        if not all(env_future.done() for _, env_future in waits):
            return
        self._pending = None
        resumable = 0
        for state, env_future in waits:
            try:
                state.env_snapshot = env_future.result()
                resumable += 1
            except Exception:  # noqa: BLE001 -- a lost episode: that sample will start over
                for group in states:
                    if state in group.samples:
                        group.samples.remove(state)
        try:
            self.store.save(step, states)
        except Exception as error:  # noqa: BLE001 -- reported to the caller
            future.set_exception(error)
            return
        future.set_result(resumable)

    def _capture(self, groups: Iterable[GroupSlot]):
        """Copies of every group in flight: scored samples, and samples waiting on the policy
        after at least one environment step (with a request for their environment snapshot)."""
        states, waits = [], []
        for group in groups:
            kept = []
            for sample in group.samples:
                between_turns = not sample.scored and self.resumable(sample)
                if sample.scored or between_turns:
                    state = capture(sample, scored=sample.scored)
                    kept.append(state)
                    if between_turns:
                        waits.append((state, self.env_pool.snapshot(sample.episode_id)))
            states.append(GroupState(str(group.group_id), group.scheduled_at_version, kept))
        return states, waits

    def fail_all(self, message: str) -> None:
        """Fails every request not yet saved (the rollout thread stopped)."""
        with self._lock:
            requests, self._requests = self._requests, []
            if self._pending is not None:
                requests.append(self._pending[:2])
                self._pending = None
        for _, future in requests:
            future.set_exception(RuntimeError(message))


class InFlightStore:
    """`<directory>/step-<N>.pkl`: the groups in flight at checkpoint step N (written atomically;
    the newest `keep` are kept). `directory` may be a bucket (`gs://`)."""

    def __init__(self, directory: str, keep: int = 2):
        self.directory = directory
        self.keep = keep
        durable.make_dirs(directory)

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step:09d}.pkl")

    def save(self, step: int, groups: list[GroupState]) -> None:
        record = {"format": FORMAT, "step": step, "groups": groups}
        durable.write_atomically(self.path(step), lambda f: pickle.dump(record, f))
        saved = sorted(n for n in durable.list_names(self.directory) if n.endswith(".pkl"))
        for name in saved[: -self.keep]:
            durable.remove(os.path.join(self.directory, name))

    def load(self, step: int) -> list[GroupState]:
        """The groups saved at `step` ([] when none were)."""
        path = self.path(step)
        if not durable.exists(path):
            return []
        try:
            with durable.open_binary(path) as f:
                record = pickle.load(f)
        except Exception as error:  # noqa: BLE001 -- any unreadable file is reported the same
            raise InFlightError(f"{path}: unreadable ({type(error).__name__}: {error})") from None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise InFlightError(f"{path}: not an in-flight record of format {FORMAT}")
        if record.get("step") != step:
            raise InFlightError(f"{path}: holds step {record.get('step')}, not {step}")
        return list(record["groups"])
