"""The records the coordinator moves through the sample lifecycle: a `Sample` (one rollout's
buffers and state), the `GroupSlot` of one prompt's samples, and the health `Counters`.

    SCHEDULED -> GENERATING <-> IN_ENV -> SCORED
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from concurrent.futures import Future

import numpy as np

from composer_jax.actor import feedback
from composer_jax.actor.ids import GroupId, SampleId
from composer_jax.actor.rollout import Generation
from composer_jax.envs import Task
from composer_jax.infer import Completion
from composer_jax.rl.batch import Sequence


class SampleState(enum.Enum):
    SCHEDULED = "scheduled"  # its environment is starting
    GENERATING = "generating"  # waiting for or in the sampler
    IN_ENV = "in_env"  # its turn is in the environment
    SCORED = "scored"  # finished: reward known


@dataclasses.dataclass(kw_only=True, eq=False)
class Sample(Generation):
    """One sample in flight: the current generation's buffers and the finished ones."""

    group: "GroupSlot"
    index: int
    attempt: int = 0
    state: SampleState = SampleState.SCHEDULED
    request_id: int = -1
    prompt_tokens: list[int] = dataclasses.field(default_factory=list)
    # Turns (start, end, hint tokens) a feedback detector flagged: their teacher context has the
    # hint (text-feedback distillation).
    hinted: list[tuple[int, int, np.ndarray]] = dataclasses.field(default_factory=list)
    flagged: bool = False  # a reward-hack monitor flagged the episode
    sequences: list[Sequence] = dataclasses.field(default_factory=list)
    turns: list[feedback.TurnRecord] = dataclasses.field(default_factory=list)
    feedback_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    turn_span: tuple[int, int] = (0, 0)
    turn_text: str = ""
    finish_reason: str | None = None  # of the last turn
    summarising: bool = False
    summaries: int = 0
    truncated: bool = False
    reward: float = 0.0
    counts: dict = dataclasses.field(default_factory=dict)
    pending: Future | None = None
    resume_from: int | None = None  # resumed from a snapshot: routes already known

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

    @property
    def between_turns(self) -> bool:
        """Waiting on the policy after at least one environment step (not summarising): the
        state an in-flight record can resume."""
        return (
            self.state is SampleState.GENERATING
            and not self.summarising
            and self.counts.get("turns", 0) > 0
        )

    def add_turn(self, completion: Completion, kinds) -> None:
        self.turn_span = (len(self.tokens), len(self.tokens) + len(completion.tokens))
        super().add_turn(completion, kinds)

    def close_generation(self, num_moe_layers: int, k: int) -> None:
        """Turns the current buffers into a Sequence (with its teacher context if flagged)."""
        try:
            seq = self.to_sequence(self.index, num_moe_layers, k, self.hinted)
        except RuntimeError as e:
            raise RuntimeError(f"{self.episode_id}: {e}") from None
        self.sequences.append(seq)

    def clear_generation(self) -> None:
        """Empties the current generation's buffers (a summary closed it)."""
        self.tokens, self.kinds, self.policy, self.logprobs = [], [], [], []
        self.versions, self.routes, self.hinted = [], [], []

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
    reward_sum: float = 0.0  # task rewards of every sample of a finished group (trained or not)
    reward_samples: int = 0  # how many samples reward_sum adds up
    feedback: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    flagged_samples: int = 0  # finished samples a reward-hack monitor flagged (reward zeroed)
    monitor_flags: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def metrics(self) -> dict[str, float]:
        """The counters as metrics (cumulative since the start of this process)."""
        out = {
            "groups_scheduled": self.groups_scheduled,
            "groups_finished": self.groups_finished,
            "samples_requeued": self.samples_requeued,
            "samples_resumed": self.samples_resumed,
            "samples_finished": self.samples_finished,
            "rollout_reward_sum": self.reward_sum,
            "rollout_reward_samples": self.reward_samples,
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
