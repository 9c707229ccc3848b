"""The records the coordinator moves through the sample lifecycle: a `Sample` (one rollout's
scheduling state around its workflow episode), the `GroupSlot` of one prompt's samples, and the
health `Counters`.

    SCHEDULED -> GENERATING <-> IN_ENV -> SCORED
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from concurrent.futures import Future

from composer_jax.actor.ids import GroupId, SampleId
from composer_jax.agent import EpisodeOutcome
from composer_jax.envs import Task


class SampleState(enum.Enum):
    SCHEDULED = "scheduled"  # its environment is starting
    GENERATING = "generating"  # waiting for or in the sampler
    IN_ENV = "in_env"  # its turn is in the environment
    SCORED = "scored"  # finished: reward known


@dataclasses.dataclass(kw_only=True, eq=False)
class Sample:
    """One sample in flight: where it is, and the workflow's episode (`composer_jax.agent`) that
    decides its contexts."""

    group: "GroupSlot"
    index: int
    attempt: int = 0
    state: SampleState = SampleState.SCHEDULED
    request_id: int = -1
    pending: Future | None = None  # its environment's start or step
    episode: object | None = None  # the workflow's state (a restored one before it resumes)
    next_request: object | None = None  # the request waiting for a sampler slot
    outcome: EpisodeOutcome | None = None  # once scored

    @property
    def sample_id(self) -> SampleId:
        return SampleId(self.group.group_id, self.index, self.attempt)

    @property
    def episode_id(self) -> str:
        """Its environment's id in the pool (a new attempt gets a new episode)."""
        return str(self.sample_id)

    @property
    def scored(self) -> bool:
        return self.state is SampleState.SCORED

    def reset(self) -> None:
        """Forgets everything of a failed attempt (the sample starts over)."""
        fresh = Sample(group=self.group, index=self.index, attempt=self.attempt + 1)
        self.__dict__.update(fresh.__dict__)


@dataclasses.dataclass(eq=False)
class GroupSlot:
    group_id: GroupId
    task: Task
    samples: list[Sample] = dataclasses.field(default_factory=list)
    scheduled_at_version: int = 0

    @classmethod
    def fresh(cls, group_id: GroupId, task: Task, size: int, version: int) -> GroupSlot:
        group = cls(group_id, task, scheduled_at_version=version)
        group.samples = [Sample(group=group, index=i) for i in range(size)]
        return group

    @property
    def scored(self) -> bool:
        return all(s.scored for s in self.samples)


@dataclasses.dataclass
class Counters:
    """Health and lifecycle counters (a snapshot is logged with every step)."""

    groups_scheduled: int = 0
    groups_finished: int = 0
    groups_without_tokens: int = 0  # every sample gave up before its first token: not trained
    samples_finished: int = 0
    samples_requeued: int = 0
    samples_resumed: int = 0  # restored mid-episode from an in-flight record
    env_failures: int = 0
    env_errors: int = 0  # failures raised by the environment itself, not a lost worker
    sampler_failures: int = 0
    summaries: int = 0
    truncated: int = 0
    turns: int = 0
    weight_updates_in_flight: int = 0
    # Task rewards of every measured sample of a finished group (trained or not): all but the
    # abandoned ones, whose 0 says nothing of the policy (`EpisodeOutcome.abandoned`).
    reward_sum: float = 0.0
    reward_samples: int = 0  # how many samples reward_sum adds up
    samples_abandoned: int = 0
    feedback: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    flagged_samples: int = 0  # finished samples a reward-hack monitor flagged (reward zeroed)
    monitor_flags: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def metrics(self) -> dict[str, float]:
        """The counters as metrics (cumulative since the start of this process)."""
        out = {
            "groups_scheduled": self.groups_scheduled,
            "groups_finished": self.groups_finished,
            "groups_without_tokens": self.groups_without_tokens,
            "samples_requeued": self.samples_requeued,
            "samples_resumed": self.samples_resumed,
            "samples_finished": self.samples_finished,
            "rollout_reward_sum": self.reward_sum,
            "rollout_reward_samples": self.reward_samples,
            "samples_abandoned": self.samples_abandoned,
            "env_failures": self.env_failures,
            "env_errors": self.env_errors,
            "sampler_failures": self.sampler_failures,
            "summaries_total": self.summaries,
            "truncated_total": self.truncated,
            "weight_updates_in_flight": self.weight_updates_in_flight,
            "flagged_samples": self.flagged_samples,
        }
        out.update({f"feedback/{name}": n for name, n in self.feedback.items()})
        out.update({f"monitor/{kind}": n for kind, n in self.monitor_flags.items()})
        return out
