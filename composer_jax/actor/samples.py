"""Finished samples and groups as the actor loop moves them: rollout -> ledger -> training batch.

A sample is one rollout of a prompt: one `Sequence` per generation (several when it summarised).
A finished group is persisted in the `GroupLedger` as flat arrays (sequences concatenated, with
their lengths), so the trainer can rebuild the exact sequences after a restart. Pure numpy.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from composer_jax.actor.ledger import Group
from composer_jax.agent import EpisodeOutcome, reward_weights
from composer_jax.config import RLConfig
from composer_jax.parallel.packing import balanced_row_order
from composer_jax.rl.batch import Sequence, TrajectoryBatch, first_fit, pack_trajectories
from composer_jax.rl.length_penalty import sample_rewards


def host_advantages(rewards: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """Task reward minus the mean of the group's trained samples, 0 for an abandoned one (the
    trainer recomputes them with KL and length terms)."""
    rewards = np.asarray(rewards, np.float32)
    if not trained.any():
        return np.zeros_like(rewards)
    return np.where(trained, rewards - rewards[trained].mean(), 0.0).astype(np.float32)


def trained_samples(group: Group) -> np.ndarray:
    """Which samples of the group count in its advantages: all but the abandoned ones (an
    environment that failed for good, a prompt with no room to answer; `EpisodeOutcome`)."""
    abandoned = group.metadata.get("abandoned") or [False] * len(group.rewards)
    return ~np.asarray(abandoned, bool)


def make_group(group_id: str, prompt_id: str, samples: list[EpisodeOutcome]) -> Group:
    """A ledger record of one finished group; sequence i of the flat arrays belongs to
    sample `sequence_sample[i]` (0..G-1). Each behaviour reward the episodes computed is kept
    (`arrays["behaviour"][name]`), weighted only when a batch is packed."""
    sequences, owner = [], []
    for index, sample in enumerate(samples):
        for seq in sample.sequences:
            sequences.append(seq)
            owner.append(index)
    cat = lambda field, dtype: np.concatenate([getattr(s, field) for s in sequences]).astype(dtype)  # noqa: E731
    arrays = {
        "tokens": cat("tokens", np.int32),
        "kinds": cat("kinds", np.int32),
        "policy_mask": cat("policy_mask", bool),
        "sampler_logprobs": cat("sampler_logprobs", np.float32),
        "sequence_lengths": np.array([len(s) for s in sequences], np.int32),
        "sequence_sample": np.array(owner, np.int32),
        "num_tool_calls": np.array([s.num_tool_calls for s in samples], np.float32),
        "num_turns": np.array([s.num_turns for s in samples], np.float32),
        "behaviour": {
            name: np.array([s.behaviour.get(name, 0.0) for s in samples], np.float32)
            for name in sorted({name for s in samples for name in s.behaviour})
        },
    }
    if sequences[0].router_indices is not None:
        arrays["router_indices"] = np.concatenate([s.router_indices for s in sequences], axis=1)
    flagged = [s.teacher_tokens is not None for s in sequences]
    if any(flagged):
        arrays["teacher_lengths"] = np.array(
            [0 if s.teacher_tokens is None else len(s.teacher_tokens) for s in sequences], np.int32
        )
        arrays["teacher_tokens"] = np.concatenate(
            [s.teacher_tokens for s in sequences if s.teacher_tokens is not None]
        ).astype(np.int32)
        arrays["teacher_target_index"] = np.concatenate(
            [
                np.full(len(s), -1, np.int32)
                if s.teacher_tokens is None
                else s.teacher_target_index
                for s in sequences
            ]
        ).astype(np.int32)
    rewards = np.array([s.reward for s in samples], np.float32)
    metadata = {
        "summaries": [s.summaries for s in samples],
        "truncated": [bool(s.truncated) for s in samples],
        "abandoned": [bool(s.abandoned) for s in samples],
        "feedback": [s.feedback for s in samples],
        "policy_tokens": [s.policy_tokens for s in samples],
        "thinking_tokens": [s.thinking_tokens for s in samples],
    }
    return Group(
        group_id=group_id,
        prompt_id=prompt_id,
        policy_versions=cat("policy_versions", np.int32)[cat("policy_mask", bool)],
        advantages=host_advantages(rewards, ~np.asarray(metadata["abandoned"], bool)),
        rewards=rewards,
        arrays=dict(arrays, policy_versions_all=cat("policy_versions", np.int32)),
        metadata=metadata,
    )


def group_sequences(group: Group, first_sample: int = 0) -> list[Sequence]:
    """The sequences of a ledger group, sample indices offset by `first_sample`."""
    a = group.arrays
    bounds = np.concatenate([[0], np.cumsum(a["sequence_lengths"])])
    has_teacher = "teacher_lengths" in a
    if has_teacher:
        t_bounds = np.concatenate([[0], np.cumsum(a["teacher_lengths"])])
    out = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        teacher_tokens = teacher_index = None
        if has_teacher and a["teacher_lengths"][i] > 0:
            teacher_tokens = a["teacher_tokens"][t_bounds[i] : t_bounds[i + 1]]
            teacher_index = a["teacher_target_index"][start:end]
        out.append(
            Sequence(
                sample_index=first_sample + int(a["sequence_sample"][i]),
                tokens=a["tokens"][start:end],
                kinds=a["kinds"][start:end],
                policy_mask=a["policy_mask"][start:end],
                sampler_logprobs=a["sampler_logprobs"][start:end],
                policy_versions=a["policy_versions_all"][start:end],
                router_indices=(
                    a["router_indices"][:, start:end] if "router_indices" in a else None
                ),
                teacher_tokens=teacher_tokens,
                teacher_target_index=teacher_index,
            )
        )
    return out


TEACHER_HINT_ROOM = 512


def _bucket(n: int, multiple: int) -> int:
    """The next power of two >= n, rounded up to a multiple (one compile per bucket)."""
    size = 1
    while size < n:
        size *= 2
    return -(-size // multiple) * multiple


def groups_to_batch(
    groups: list[Group],
    seq_len: int,
    row_multiple: int = 1,
    weights: list[float] | None = None,
    min_rows: int = 1,
    reward_weights: dict[str, float] | None = None,
) -> TrajectoryBatch:
    """Packs whole groups into one training batch. Rows (and hinted rows) are bucketed to powers of
    two rounded to `row_multiple` (the data-parallel size), so steps reuse a few compiled shapes.
    Rows are ordered so that every data-parallel rank gets equal attention work.
    `weights`: per group advantage scale (stale groups), None for all ones (always attached, so
    the batch's structure never changes). `reward_weights`: weight of each behaviour reward
    component (`agent.reward_weights`); the batch's rewards are "task" plus the weighted
    components with a nonzero weight. An abandoned sample gets group id -1: no advantage, and
    no place in its group's baseline."""
    reward_weights = {k: w for k, w in (reward_weights or {}).items() if w}
    sequences, group_id, rewards, tool_calls, turns, sample_weight = [], [], [], [], [], []
    behaviour = {name: [] for name in reward_weights}
    for g_index, group in enumerate(groups):
        first = len(group_id)
        sequences += group_sequences(group, first)
        G = len(group.rewards)
        group_id += np.where(trained_samples(group), g_index, -1).tolist()
        rewards.append(group.rewards)
        tool_calls.append(group.arrays["num_tool_calls"])
        turns.append(group.arrays["num_turns"])
        recorded = group.arrays.get("behaviour", {})
        for name, weight in reward_weights.items():
            behaviour[name].append(weight * recorded.get(name, np.zeros(G, np.float32)))
        sample_weight += [1.0 if weights is None else weights[g_index]] * G
    placed = first_fit([len(s) for s in sequences], seq_len, None)
    rows = _bucket(max(max(r for r, _ in placed) + 1, min_rows), row_multiple)
    teacher_rows = teacher_len = None
    hinted = [s.teacher_tokens for s in sequences if s.teacher_tokens is not None]
    if hinted:
        # Hinted rows: room for the longest sequence plus TEACHER_HINT_ROOM hint tokens.
        longest = max(len(t) for t in hinted)
        teacher_len = max(seq_len + TEACHER_HINT_ROOM, -(-longest // 256) * 256)
        t_placed = first_fit([len(t) for t in hinted], teacher_len, None)
        teacher_rows = _bucket(max(r for r, _ in t_placed) + 1, row_multiple)
    batch = pack_trajectories(
        sequences,
        group_id=np.asarray(group_id, np.int32),
        rewards={
            "task": np.concatenate(rewards),
            **{name: np.concatenate(parts).astype(np.float32) for name, parts in behaviour.items()},
        },
        seq_len=seq_len,
        num_rows=rows,
        num_tool_calls=np.concatenate(tool_calls),
        num_turns=np.concatenate(turns),
        teacher_seq_len=teacher_len,
        num_teacher_rows=teacher_rows,
        sample_weight=np.asarray(sample_weight, np.float32),
    )
    return balance_rows(batch, row_multiple)


def group_alone(group: Group, rl: RLConfig) -> TrajectoryBatch:
    """The group packed alone, with the run's behaviour reward weights, as the trainer would
    reward it. Rows are padded to a power of two (padding adds nothing), so eager ops on it
    compile for a few lengths instead of every group's longest sequence."""
    longest = int(np.max(group.arrays["sequence_lengths"]))
    seq_len = 1 << (longest - 1).bit_length()
    weights = reward_weights(rl.agent.behaviour_rewards)
    return groups_to_batch([group], seq_len=seq_len, reward_weights=weights)


def total_rewards(group: Group, rl: RLConfig) -> np.ndarray:
    """Each sample's total reward before the KL term (task reward, weighted behaviour rewards,
    minus the length penalty), exactly as the trainer computes it (`rl.sample_rewards` on the
    group packed alone)."""
    totals, _ = sample_rewards(group_alone(group, rl), rl.objective)
    return np.asarray(totals)[: len(group.rewards)]


def balance_rows(batch: TrajectoryBatch, num_ranks: int) -> TrajectoryBatch:
    """Reorders rows so each data-parallel rank (a contiguous block of rows) gets equal attention
    work (`parallel.packing.balanced_row_order`); hinted rows are indexed by value, unaffected."""
    if num_ranks <= 1:
        return batch
    order = balanced_row_order(np.asarray(batch.segment_ids_BT), num_ranks)
    rows = {
        name: np.asarray(getattr(batch, name))[order]
        for name in (
            "tokens_BT",
            "positions_BT",
            "segment_ids_BT",
            "policy_mask_BT",
            "kinds_BT",
            "sampler_logprobs_BT",
            "policy_versions_BT",
            "sample_index_BT",
        )
    }
    if batch.router_indices_LBTK is not None:
        rows["router_indices_LBTK"] = np.asarray(batch.router_indices_LBTK)[:, order]
    if batch.teacher_index_BT is not None:
        rows["teacher_index_BT"] = np.asarray(batch.teacher_index_BT)[order]
    return dataclasses.replace(batch, **rows)
