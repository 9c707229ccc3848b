"""The trajectory batch the RL loss trains on, and the host-side packer that builds it.

A *sample* is one rollout answering a prompt; samples of the same prompt form a group. A sample is
one or more *sequences*: a self-summarising rollout is a chain of generations, each starting from
a context that carries the previous generation's summary. Sequences are first-fit packed into rows
the way pretraining documents are (segment ids, positions restarting at 0), and every token points
back to its sample, so all sequences of a chain share the sample's advantage.

Token t's sampler log-prob is stored at t; the trainer predicts it from position t - 1.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import numpy as np
from flax import struct

from composer_jax.model.moe import UNROUTED


class SegmentKind(enum.IntEnum):
    """What a token is. Context carried over from an earlier generation (the prompt, a summary the
    new generation starts from) is PROMPT, so each token is counted once per sample."""

    PROMPT = 0
    THINKING = 1
    TOOL_CALL = 2
    TOOL_OUTPUT = 3
    FINAL_MESSAGE = 4
    SUMMARY = 5


@struct.dataclass
class TrajectoryBatch:
    """Packed rows [B, T] of sequences plus per-sample arrays [N] (a pytree; jit-friendly)."""

    tokens_BT: jax.Array  # int32
    positions_BT: jax.Array  # int32, restart at 0 per sequence
    segment_ids_BT: jax.Array  # int32, 0 = padding
    policy_mask_BT: jax.Array  # bool: the token was sampled by the policy (trained on)
    kinds_BT: jax.Array  # int32 SegmentKind
    sampler_logprobs_BT: jax.Array  # float32 log-prob of the token under the sampler
    policy_versions_BT: jax.Array  # int32 policy version that sampled the token
    sample_index_BT: jax.Array  # int32 sample of the token, -1 on padding
    group_id_N: jax.Array  # int32 prompt group of each sample, -1: an empty slot or abandoned
    rewards_N: dict[str, jax.Array]  # named reward components (task, behaviour), float32
    num_tool_calls_N: jax.Array  # float32
    num_turns_N: jax.Array  # float32
    router_indices_LBTK: jax.Array | None = None  # int32 experts the sampler used per MoE layer
    # Per-sample advantage scale (a stale group re-weighted by the scheduler); None: all ones.
    sample_weight_N: jax.Array | None = None
    # Text feedback: hinted rows [Bt, Tt] and, per student token distilled, the flat index
    # (row * Tt + column) of the same token in the hinted rows; -1 elsewhere.
    teacher_tokens_BT: jax.Array | None = None
    teacher_positions_BT: jax.Array | None = None
    teacher_segment_ids_BT: jax.Array | None = None
    teacher_index_BT: jax.Array | None = None

    @property
    def num_samples(self) -> int:
        return self.group_id_N.shape[0]


@dataclasses.dataclass
class Sequence:
    """One generation of a sample, as numpy arrays of length L (host side, before packing)."""

    sample_index: int
    tokens: np.ndarray
    kinds: np.ndarray
    policy_mask: np.ndarray
    sampler_logprobs: np.ndarray
    policy_versions: np.ndarray
    router_indices: np.ndarray | None = None  # [num_moe_layers, L, k]
    # Flagged turn: the same context with a hint inserted, and for each of the L tokens the index
    # of the same token in teacher_tokens (-1 where it is not distilled).
    teacher_tokens: np.ndarray | None = None
    teacher_target_index: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)


def first_fit(lengths: list[int], row_len: int, num_rows: int | None) -> list[tuple[int, int]]:
    """(row, offset) of each item, first row with room; raises when an item cannot be placed."""
    used: list[int] = []
    places = []
    for i, length in enumerate(lengths):
        if length > row_len:
            raise ValueError(f"sequence {i} has {length} tokens, more than a row ({row_len})")
        row = next((r for r, u in enumerate(used) if u + length <= row_len), None)
        if row is None:
            if num_rows is not None and len(used) == num_rows:
                raise ValueError(f"sequence {i} does not fit in {num_rows} rows of {row_len}")
            used.append(0)
            row = len(used) - 1
        places.append((row, used[row]))
        used[row] += length
    return places


def _row_layout(places, lengths, num_rows, row_len):
    """Segment ids and positions of packed rows."""
    segment_ids = np.zeros((num_rows, row_len), np.int32)
    positions = np.zeros((num_rows, row_len), np.int32)
    next_segment = np.ones(num_rows, np.int32)
    for (row, offset), length in zip(places, lengths):
        segment_ids[row, offset : offset + length] = next_segment[row]
        positions[row, offset : offset + length] = np.arange(length)
        next_segment[row] += 1
    return segment_ids, positions


def _pack_router(sequences: list[Sequence], places, B: int, seq_len: int) -> np.ndarray | None:
    """[L, B, T, k] router indices of the packed rows (padding `UNROUTED`), or None when no
    sequence has them."""
    with_router = [s.router_indices is not None for s in sequences]
    if not any(with_router):
        return None
    if not all(with_router):
        raise ValueError("either every sequence has router indices or none has")
    L, _, k = sequences[0].router_indices.shape
    router = np.full((L, B, seq_len, k), UNROUTED, np.int32)
    for s, (row, offset) in zip(sequences, places):
        router[:, row, offset : offset + len(s)] = s.router_indices
    return router


def _pack_teacher(
    sequences: list[Sequence],
    places,
    B: int,
    seq_len: int,
    teacher_seq_len: int | None,
    num_teacher_rows: int | None,
) -> dict[str, np.ndarray]:
    """The teacher contexts of the sequences that have one, packed into rows of their own, and
    for each policy token the flat index of its target in them (-1: none); {} when none has."""
    flagged = [i for i, s in enumerate(sequences) if s.teacher_tokens is not None]
    if not flagged:
        return {}
    t_len = teacher_seq_len or max(len(sequences[i].teacher_tokens) for i in flagged)
    t_lengths = [len(sequences[i].teacher_tokens) for i in flagged]
    t_places = first_fit(t_lengths, t_len, num_teacher_rows)
    Bt = num_teacher_rows or max(r for r, _ in t_places) + 1
    t_segments, t_positions = _row_layout(t_places, t_lengths, Bt, t_len)
    t_tokens = np.zeros((Bt, t_len), np.int32)
    teacher_index = np.full((B, seq_len), -1, np.int32)
    for i, (t_row, t_offset) in zip(flagged, t_places):
        s, (row, offset) = sequences[i], places[i]
        t_tokens[t_row, t_offset : t_offset + len(s.teacher_tokens)] = s.teacher_tokens
        target = np.asarray(s.teacher_target_index)
        flat = np.where(target >= 0, t_row * t_len + t_offset + target, -1)
        teacher_index[row, offset : offset + len(s)] = flat
    return dict(
        teacher_tokens_BT=t_tokens,
        teacher_positions_BT=t_positions,
        teacher_segment_ids_BT=t_segments,
        teacher_index_BT=teacher_index,
    )


def pack_trajectories(
    sequences: list[Sequence],
    group_id: np.ndarray,
    rewards: dict[str, np.ndarray],
    seq_len: int,
    num_rows: int | None = None,
    num_tool_calls: np.ndarray | None = None,
    num_turns: np.ndarray | None = None,
    teacher_seq_len: int | None = None,
    num_teacher_rows: int | None = None,
    sample_weight: np.ndarray | None = None,
) -> TrajectoryBatch:
    """Packs sequences into rows (first fit) and attaches per-sample arrays of length N.

    `num_rows` / `num_teacher_rows` fix the batch shape (a jitted step wants one shape); None
    uses as many rows as needed. Router indices and teacher contexts are packed when present.
    """
    N = len(group_id)
    if any(not 0 <= s.sample_index < N for s in sequences):
        raise ValueError(f"every sequence's sample_index must lie in [0, {N})")
    lengths = [len(s) for s in sequences]
    places = first_fit(lengths, seq_len, num_rows)
    B = num_rows if num_rows is not None else max((r for r, _ in places), default=-1) + 1
    segment_ids, positions = _row_layout(places, lengths, B, seq_len)

    def scatter(field: str, dtype, fill) -> np.ndarray:
        out = np.full((B, seq_len), fill, dtype)
        for s, (row, offset) in zip(sequences, places):
            out[row, offset : offset + len(s)] = getattr(s, field)
        return out

    router = _pack_router(sequences, places, B, seq_len)
    teacher = _pack_teacher(sequences, places, B, seq_len, teacher_seq_len, num_teacher_rows)
    zeros_N = np.zeros(N, np.float32)
    return TrajectoryBatch(
        tokens_BT=scatter("tokens", np.int32, 0),
        positions_BT=positions,
        segment_ids_BT=segment_ids,
        policy_mask_BT=scatter("policy_mask", bool, False),
        kinds_BT=scatter("kinds", np.int32, SegmentKind.PROMPT),
        sampler_logprobs_BT=scatter("sampler_logprobs", np.float32, 0.0),
        policy_versions_BT=scatter("policy_versions", np.int32, 0),
        sample_index_BT=scatter("sample_index", np.int32, -1),
        group_id_N=np.asarray(group_id, np.int32),
        rewards_N={name: np.asarray(r, np.float32) for name, r in rewards.items()},
        num_tool_calls_N=np.asarray(
            zeros_N if num_tool_calls is None else num_tool_calls, np.float32
        ),
        num_turns_N=np.asarray(zeros_N if num_turns is None else num_turns, np.float32),
        router_indices_LBTK=router,
        sample_weight_N=None if sample_weight is None else np.asarray(sample_weight, np.float32),
        **teacher,
    )
