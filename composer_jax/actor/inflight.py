"""Rollouts in flight, saved with each checkpoint so that a restart resumes them mid-episode.

At a checkpoint the coordinator records every group still in flight: its scored samples whole, and
each sample that waits on the policy between two turns as its token buffers plus a snapshot of its
environment (`Episode.snapshot`: workspace files, counts, call log). A restart from that checkpoint
rebuilds those samples: the environment is restored, the buffers are prefilled again (the routes
the sampler used for them are kept) and generation goes on with the next turn. Samples caught
anywhere else (on their first turn, inside the environment, summarising) start over, as do samples
whose tokens come from a policy version the restored trainer never had.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import tempfile

FORMAT = 1
# The per-sample state a resumed sample needs (`lifecycle.Sample` fields).
SAMPLE_FIELDS = (
    "tokens",
    "kinds",
    "policy",
    "logprobs",
    "versions",
    "routes",
    "prompt_tokens",
    "flagged",
    "sequences",
    "turns",
    "feedback_counts",
    "turn_span",
    "turn_text",
    "finish_reason",
    "summaries",
    "truncated",
    "reward",
    "counts",
)


class InFlightError(RuntimeError):
    """An in-flight record that cannot be read."""


@dataclasses.dataclass
class SampleState:
    index: int
    attempt: int
    scored: bool
    fields: dict
    env_snapshot: dict | None = None  # None once scored

    @property
    def newest_version(self) -> int:
        versions = list(self.fields["versions"])
        versions += [int(seq.policy_versions.max(initial=0)) for seq in self.fields["sequences"]]
        return max(versions, default=0)


@dataclasses.dataclass
class GroupState:
    group_id: str
    scheduled_at_version: int
    samples: list[SampleState]  # the samples that are kept; the others start over


def capture(sample, scored: bool) -> SampleState:
    """A copy of `sample`'s resumable fields (the live sample goes on changing)."""
    fields = {name: copy.deepcopy(getattr(sample, name)) for name in SAMPLE_FIELDS}
    return SampleState(sample.index, sample.attempt, scored, fields)


def apply(state: SampleState, sample) -> None:
    for name, value in state.fields.items():
        setattr(sample, name, value)
    sample.attempt = state.attempt


class InFlightStore:
    """`<directory>/step-<N>.pkl`: the groups in flight at checkpoint step N (written atomically;
    the newest `keep` are kept)."""

    def __init__(self, directory: str, keep: int = 2):
        self.directory = directory
        self.keep = keep
        os.makedirs(directory, exist_ok=True)

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step:09d}.pkl")

    def save(self, step: int, groups: list[GroupState]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump({"format": FORMAT, "step": step, "groups": groups}, f)
        os.replace(tmp, self.path(step))
        saved = sorted(n for n in os.listdir(self.directory) if n.endswith(".pkl"))
        for name in saved[: -self.keep]:
            os.remove(os.path.join(self.directory, name))

    def load(self, step: int) -> list[GroupState]:
        """The groups saved at `step` ([] when none were)."""
        path = self.path(step)
        if not os.path.exists(path):
            return []
        try:
            with open(path, "rb") as f:
                record = pickle.load(f)
        except Exception as error:  # noqa: BLE001 -- any unreadable file is reported the same
            raise InFlightError(f"{path}: unreadable ({type(error).__name__}: {error})") from None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise InFlightError(f"{path}: not an in-flight record of format {FORMAT}")
        if record.get("step") != step:
            raise InFlightError(f"{path}: holds step {record.get('step')}, not {step}")
        return list(record["groups"])
