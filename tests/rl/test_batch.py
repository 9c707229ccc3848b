"""Packing trajectories, and self-summarisation credit: a chain shares its sample's advantage."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.rl import (
    SegmentKind,
    Sequence,
    TrajectoryBatch,
    group_advantages,
    pack_trajectories,
    policy_objective,
)
from tests.rl import toy

K = SegmentKind
V = 11


def _sequence(sample, kinds, rng, layers=2, k=2, hinted=False):
    kinds = np.asarray(kinds)
    n = len(kinds)
    seq = Sequence(
        sample_index=sample,
        tokens=rng.integers(0, V, size=n),
        kinds=kinds,
        policy_mask=(kinds != K.PROMPT) & (kinds != K.TOOL_OUTPUT),
        sampler_logprobs=np.log(rng.uniform(0.1, 1, size=n)),
        policy_versions=rng.integers(3, 6, size=n),
        router_indices=rng.integers(0, 8, size=(layers, n, k)),
    )
    if hinted:  # hint of 3 tokens inserted after the prompt; the turn after it is distilled
        seq.teacher_tokens = np.concatenate([seq.tokens[:2], [7, 7, 7], seq.tokens[2:]])
        seq.teacher_target_index = np.where(np.arange(n) >= 2, np.arange(n) + 3, -1)
    return seq


def test_pack_places_every_field_first_fit():
    rng = np.random.default_rng(0)
    lengths = [5, 9, 3, 6, 2]
    sequences = [
        _sequence(i, [K.PROMPT] * 2 + [K.THINKING] * (n - 2), rng, hinted=i == 3)
        for i, n in enumerate(lengths)
    ]
    batch = pack_trajectories(
        sequences, np.arange(5) // 2, {"task": np.arange(5.0)}, seq_len=12, num_rows=3
    )
    assert batch.tokens_BT.shape == (3, 12)
    # First fit: row 0 = [5, 3, 2 tokens], row 1 = [9], row 2 = [6].
    np.testing.assert_array_equal(batch.segment_ids_BT[0], [1] * 5 + [2] * 3 + [3] * 2 + [0] * 2)
    np.testing.assert_array_equal(batch.positions_BT[0, 5:8], [0, 1, 2])
    places = {0: (0, 0), 1: (1, 0), 2: (0, 5), 3: (2, 0), 4: (0, 8)}
    for i, (row, offset) in places.items():
        s, cols = sequences[i], slice(offset, offset + lengths[i])
        np.testing.assert_array_equal(batch.tokens_BT[row, cols], s.tokens)
        np.testing.assert_array_equal(
            batch.sampler_logprobs_BT[row, cols], s.sampler_logprobs.astype(np.float32)
        )
        np.testing.assert_array_equal(batch.policy_versions_BT[row, cols], s.policy_versions)
        np.testing.assert_array_equal(batch.sample_index_BT[row, cols], i)
        np.testing.assert_array_equal(batch.router_indices_LBTK[:, row, cols], s.router_indices)
    assert not batch.policy_mask_BT[batch.segment_ids_BT == 0].any()
    assert np.all(batch.sample_index_BT[batch.segment_ids_BT == 0] == -1)
    # Teacher rows: the hinted sequence; each distilled token points at the same token.
    flat = np.asarray(batch.teacher_tokens_BT).reshape(-1)
    index = np.asarray(batch.teacher_index_BT)
    distilled = index >= 0
    np.testing.assert_array_equal(flat[index[distilled]], batch.tokens_BT[distilled])
    assert distilled.sum() == lengths[3] - 2
    # A jittable pytree.
    leaves = jax.tree.leaves(jax.jit(lambda b: b)(batch))
    assert len(leaves) == len(jax.tree.leaves(batch))
    with pytest.raises(ValueError, match="does not fit"):
        pack_trajectories(sequences, np.arange(5) // 2, {}, seq_len=12, num_rows=2)
    with pytest.raises(ValueError, match="more than a row"):
        pack_trajectories(sequences, np.arange(5) // 2, {}, seq_len=8)


def test_self_summarisation_chain_shares_one_advantage():
    """A chain of three generations joined by summaries trains as three sequences whose policy
    tokens, summaries included, all carry the sample's advantage; and its loss is the sum of the
    pieces' losses, as if each were trained alone with that advantage."""
    rng = np.random.default_rng(1)
    chain = [
        _sequence(0, [K.PROMPT] * 3 + [K.THINKING] * 4 + [K.SUMMARY] * 3, rng),
        _sequence(
            0, [K.PROMPT] * 4 + [K.TOOL_CALL] * 2 + [K.TOOL_OUTPUT] * 2 + [K.SUMMARY] * 2, rng
        ),
        _sequence(0, [K.PROMPT] * 3 + [K.THINKING] * 2 + [K.FINAL_MESSAGE] * 3, rng),
    ]
    others = [_sequence(i, [K.PROMPT] * 3 + [K.THINKING] * (2 + i), rng) for i in (1, 2, 3)]
    group_id, rewards = np.array([0, 0, 0, 0]), {"task": np.array([2.0, 0.5, -1.0, 0.0])}
    batch = pack_trajectories(chain + others, group_id, rewards, seq_len=16)
    cfg = toy.config(max_generation_len=32, importance_weighting="truncated")
    logits = jnp.asarray(rng.normal(size=(*batch.tokens_BT.shape, V)), jnp.float32)
    loss, metrics = jax.jit(policy_objective, static_argnums=2)(logits, batch, cfg)

    # Reference: each piece alone in its own batch, its advantage fixed to the chain's.
    advantage = np.asarray(
        group_advantages(jnp.asarray(rewards["task"]), jnp.asarray(group_id), cfg.advantage_mode)
    )
    total = 0.0
    for piece in chain + others:
        row, offset = _row_of(batch, piece)
        logits_piece = np.asarray(logits[row, offset : offset + len(piece)], np.float64)
        logp = logits_piece - np.log(np.exp(logits_piece).sum(-1, keepdims=True))
        picked = logp[np.arange(len(piece) - 1), piece.tokens[1:]]
        ratio = np.minimum(np.exp(picked - piece.sampler_logprobs[1:]), cfg.importance_cap)
        weight = piece.policy_mask[1:] * ratio * advantage[piece.sample_index]
        total += -np.sum(weight * picked)
    np.testing.assert_allclose(loss, total / (4 * 32), rtol=1e-5)
    assert int(metrics["policy_tokens"]) == sum(int(s.policy_mask.sum()) for s in chain + others)


def _row_of(batch: TrajectoryBatch, piece: Sequence) -> tuple[int, int]:
    """(row, offset) where a packed piece starts (its tokens and sample index match there)."""
    tokens, samples = np.asarray(batch.tokens_BT), np.asarray(batch.sample_index_BT)
    for row in range(tokens.shape[0]):
        for offset in range(tokens.shape[1] - len(piece) + 1):
            cols = slice(offset, offset + len(piece))
            if np.array_equal(tokens[row, cols], piece.tokens) and np.all(
                samples[row, cols] == piece.sample_index
            ):
                return row, offset
    raise AssertionError("piece not found")
