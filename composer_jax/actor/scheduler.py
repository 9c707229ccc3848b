"""The staleness policy and the prompt order, in one place.

At scheduling time (`Scheduler`): the run's prompts in order (`rl.rollout.epochs` passes over the
distinct tasks, each pass's groups under their own prompt ids), each as a group of `group_size`
samples, admitted only while the trainer version the group will meet (the current version plus
the untrained groups ahead of it) is within `max_staleness` of the sampler's; dropped groups'
prompts come back first in line as retries; past half the prompts a share of the groups goes to
the hardest prompts seen, each as a fresh variant of the task (another instance of the same
problem, a new prompt), so no prompt id is ever trained twice.

At training time (`next_groups`): groups whose oldest token still lags more than `max_staleness`
are dropped (their prompt is scheduled again) or re-weighted, per `stale_policy`; with dynamic
sampling, groups whose total rewards are all equal carry no signal and are dropped; damaged
ledger records are set aside and their prompts redone.
"""

from __future__ import annotations

import collections
import logging
import re
from collections.abc import Callable

import numpy as np

from composer_jax.actor.ids import GroupId
from composer_jax.actor.ledger import DamagedGroup, Group, GroupLedger
from composer_jax.actor.samples import total_rewards, trained_samples
from composer_jax.config import RLConfig
from composer_jax.envs import Task

Variant = Callable[[Task, int], "Task | None"]

log = logging.getLogger(__name__)
_VARIANT = re.compile(r"v(\d+)$")  # a variant's prompt id: the original's, "v", its number


def admits_group(rl: RLConfig, trainer_version: int, untrained: int, sampler_version: int) -> bool:
    """Whether a group scheduled now would meet a trainer at most `max_staleness` versions ahead
    of the policy that samples it (the `untrained` groups ahead of it are trained first). A
    function of its own so that the actor-loop simulator (`composer_jax.actor.simulation`)
    applies this very rule."""
    meets = trainer_version + untrained // rl.rollout.groups_per_step
    return meets - sampler_version <= rl.rollout.max_staleness


class Scheduler:
    """Which group is sampled next. Not thread-safe: the coordinator calls it under its lock."""

    def __init__(
        self,
        cfg: RLConfig,
        prompts: list[tuple[str, Task]],
        ledger: GroupLedger,
        seed: int = 0,
        variant: Variant | None = None,
    ):
        self.cfg, self.seed, self.variant = cfg, seed, variant
        self._tasks = dict(prompts)
        self._retries = collections.Counter()  # prompt -> highest retry in the ledger
        self.revisits = 0  # variants made, by this start and earlier ones (their ids' numbers)
        seen, live, redo = set(), set(), set()
        stale = set(ledger.dropped("stale"))
        final = set(ledger.dropped()) - stale  # uninformative: played to its end
        corrupt = set(ledger.corrupt)
        for text in [*ledger, *corrupt]:
            group = GroupId.parse(text)
            self._retries[group.prompt] = max(self._retries[group.prompt], group.retry)
            seen.add(group.prompt)
            variant = _VARIANT.search(group.prompt)
            if variant is not None and group.prompt not in self._tasks:
                self.revisits = max(self.revisits, int(variant[1]))
            damaged_untrained = text in corrupt and ledger.trained_step(text) is None
            if text in stale or (damaged_untrained and text not in final):
                redo.add(group.prompt)
            else:  # pending, trained or uninformative (its file damaged since, too): final
                live.add(group.prompt)
        self._queue: collections.deque[GroupId] = collections.deque(
            GroupId(p) for p, _ in prompts if p not in seen
        )
        # A prompt whose every group was lost (stale, damaged; by an earlier start too) is
        # sampled again. Variants lived in an earlier start's memory: not redone.
        for prompt in sorted((redo - live) & set(self._tasks)):
            self._queue.append(self._retry(prompt))
        self._num_prompts = len(self._queue)
        self._hard: list[tuple[float, str]] = []  # (hardness, prompt) of finished originals
        self._variants: set[str] = set()

    def _retry(self, prompt: str) -> GroupId:
        self._retries[prompt] += 1
        return GroupId(prompt, self._retries[prompt])

    def task(self, group: GroupId) -> Task:
        return self._tasks[group.prompt]

    @property
    def queued(self) -> int:
        return len(self._queue)

    def is_queued(self, group: GroupId) -> bool:
        return group in self._queue

    def take(self, group: GroupId) -> None:
        """Removes a group from the queue (it is resumed from an in-flight record instead)."""
        self._queue.remove(group)

    def admits(self, trainer_version: int, untrained: int, sampler_version: int) -> bool:
        """`admits_group` under this run's config."""
        return admits_group(self.cfg, trainer_version, untrained, sampler_version)

    def next_group(self) -> GroupId | None:
        """The next group; past half the run's prompts, a share of them revisits the hardest
        prompts as fresh variants (when the task source makes them)."""
        cfg = self.cfg
        used = self._num_prompts - len(self._queue)
        if (
            cfg.rollout.hard_prompt_fraction > 0
            and self.variant is not None
            and self._hard
            and used >= self._num_prompts // 2
            and np.random.default_rng(self.seed + used + self.revisits).random()
            < cfg.rollout.hard_prompt_fraction
        ):
            self._hard.sort()
            _, prompt = self._hard.pop()
            fresh = self.variant(self._tasks[prompt], self.seed + len(self._tasks))
            if fresh is not None:
                self.revisits += 1
                variant = f"{prompt}v{self.revisits}"
                self._tasks[variant] = fresh
                self._variants.add(variant)
                return GroupId(variant)
        return self._queue.popleft() if self._queue else None

    def redispatch(self, group_ids: list[str]) -> None:
        """The prompts of dropped groups go first in line again, so the run covers them (but
        a variant made by an earlier start, whose task is gone: its original was trained)."""
        for text in group_ids:
            prompt = GroupId.parse(text).prompt
            if prompt in self._tasks:
                self._queue.appendleft(self._retry(prompt))
                self._num_prompts += 1

    def finished(self, group: GroupId, num_turns: int, thinking_tokens: int) -> None:
        """Records how hard an original prompt was (most turns, then most thinking tokens)."""
        original = group.prompt in self._tasks and group.prompt not in self._variants
        if self.cfg.rollout.hard_prompt_fraction > 0 and original:
            self._hard.append((num_turns * 1e6 + thinking_tokens, group.prompt))


def uniform_rewards(group: Group, rl: RLConfig) -> np.ndarray:
    """The rewards dynamic sampling compares within a group (rl.rollout.uniform_by): the task reward, or
    the total before KL (task, weighted behaviour rewards, length penalty), of its trained
    (not abandoned) samples."""
    if rl.rollout.uniform_by == "task":
        rewards = np.asarray(group.rewards)
    else:
        rewards = total_rewards(group, rl)
    return rewards[trained_samples(group)]


def is_uniform(group: Group, rl: RLConfig) -> bool:
    """Whether the group teaches nothing: its trained samples' rewards are all equal (or none
    is left)."""
    rewards = uniform_rewards(group, rl)
    return rewards.size == 0 or bool(np.ptp(rewards) == 0)


def next_groups(coordinator, ledger: GroupLedger, rl: RLConfig, version: int, interrupted=None):
    """The next batch of finished groups for the trainer at `version`: (groups, advantage
    weights, groups dropped as stale). Groups whose oldest token lags more than rl.rollout.max_staleness
    versions are dropped for good (and the wait goes on) or kept with weight
    stale_decay ** (lag - max_staleness), per rl.rollout.stale_policy; a dropped group's prompt is
    sampled again. With rl.rollout.skip_uniform_groups, groups whose samples' rewards are all equal
    (`uniform_rewards`: of the trained samples) are dropped too (not redone). Fewer groups only
    at the end of the prompt epoch; none when it is over; (None, None, dropped) when
    `interrupted()` returned True."""
    dropped = 0
    while True:
        ids = coordinator.wait_for_groups(rl.rollout.groups_per_step, interrupted=interrupted)
        if ids is None:
            return None, None, dropped
        stale = (
            ledger.drop_stale(version, rl.rollout.max_staleness)
            if rl.rollout.stale_policy == "drop"
            else []
        )
        if stale:
            dropped += len(stale)
            coordinator.groups_trained(len(stale), version)
            coordinator.redispatch(stale)
            continue
        groups, damaged = [], []
        for group_id in ids:
            try:
                groups.append(ledger.load(group_id))
            except DamagedGroup as error:  # set aside and counted by the ledger
                log.warning("%s; its prompt is sampled again", error)
                damaged.append(group_id)
        if damaged:
            coordinator.groups_trained(len(damaged), version)
            coordinator.redispatch(damaged)
            continue
        uniform = [
            g.group_id for g in groups if rl.rollout.skip_uniform_groups and is_uniform(g, rl)
        ]
        if not uniform:
            break
        ledger.drop(uniform, version, "uninformative")
        coordinator.groups_trained(len(uniform), version)
    lags = [version - g.min_version for g in groups]
    weights = [rl.rollout.stale_decay ** max(lag - rl.rollout.max_staleness, 0) for lag in lags]
    return groups, weights, dropped
