"""Ledger round trip of finished groups and the packed, rank-balanced training batch."""

import dataclasses

import numpy as np

from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.samples import (
    group_sequences,
    groups_to_batch,
    make_group,
    total_rewards,
)
from composer_jax.actor.scheduler import is_uniform
from composer_jax.agent import EpisodeOutcome, reward_weights
from composer_jax.config import RLConfig, RLObjectiveConfig
from composer_jax.parallel.packing import row_attention_lengths
from composer_jax.rl.advantages import group_advantages
from composer_jax.rl.batch import SegmentKind, Sequence
from composer_jax.rl.length_penalty import sample_rewards


def _sequence(rng, index, length, teacher=False):
    policy = rng.random(length) < 0.6
    policy[:3] = False
    tokens = rng.integers(3, 259, length).astype(np.int32)
    seq = Sequence(
        sample_index=index,
        tokens=tokens,
        kinds=np.where(policy, SegmentKind.THINKING, SegmentKind.PROMPT).astype(np.int32),
        policy_mask=policy,
        sampler_logprobs=np.where(policy, -rng.random(length), 0).astype(np.float32),
        policy_versions=np.where(policy, rng.integers(0, 4, length), 0).astype(np.int32),
        router_indices=rng.integers(0, 8, (1, length, 2)).astype(np.int32),
    )
    if teacher:
        hint = rng.integers(3, 259, 7).astype(np.int32)
        seq.teacher_tokens = np.concatenate([tokens[:5], hint, tokens[5:]])
        seq.teacher_target_index = np.where(np.arange(length) >= 5, np.arange(length) + 7, -1)
        seq.teacher_target_index = seq.teacher_target_index.astype(np.int32)
    return seq


def _group(rng, gid, lengths):
    samples = []
    for i, chain in enumerate(lengths):
        sequences = [_sequence(rng, i, n, teacher=(i == 0 and j == 0)) for j, n in enumerate(chain)]
        samples.append(
            EpisodeOutcome(sequences, reward=float(rng.random()), summaries=len(chain) - 1)
        )
    return make_group(gid, f"task-{gid}", samples), samples


def test_groups_survive_the_ledger_and_pack_balanced(tmp_path):
    rng = np.random.default_rng(0)
    ledger = GroupLedger(tmp_path)
    made = {}
    for g in range(4):
        lengths = [list(rng.integers(20, 200, rng.integers(1, 3))) for _ in range(4)]
        group, samples = _group(rng, f"g{g}", lengths)
        ledger.add(group)
        made[f"g{g}"] = samples
    loaded = [GroupLedger(tmp_path).load(f"g{g}") for g in range(4)]
    for group in loaded:
        expected = [s for sample in made[group.group_id] for s in sample.sequences]
        for got, want in zip(group_sequences(group), expected, strict=True):
            for field in ("tokens", "kinds", "policy_mask", "sampler_logprobs", "policy_versions"):
                np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
            np.testing.assert_array_equal(got.router_indices, want.router_indices)
            assert got.sample_index == want.sample_index
            if want.teacher_tokens is None:
                assert got.teacher_tokens is None
            else:
                np.testing.assert_array_equal(got.teacher_tokens, want.teacher_tokens)

    batch = groups_to_batch(loaded, seq_len=256, row_multiple=4, min_rows=16)
    rows = batch.tokens_BT.shape[0]
    assert rows % 4 == 0 and rows >= 16
    # Every sample's policy tokens arrive under its index, its whole chain included.
    per_sample = np.zeros(batch.num_samples)
    np.add.at(per_sample, np.asarray(batch.sample_index_BT)[batch.policy_mask_BT], 1)
    expected = [
        sum(int(s.policy_mask.sum()) for s in sample.sequences)
        for g in range(4)
        for sample in made[f"g{g}"]
    ]
    np.testing.assert_array_equal(per_sample, expected)
    # Hinted tokens still point at the same token after the row reordering.
    index = np.asarray(batch.teacher_index_BT)
    flat_teacher = np.asarray(batch.teacher_tokens_BT).reshape(-1)
    hinted = index >= 0
    assert hinted.any()
    np.testing.assert_array_equal(flat_teacher[index[hinted]], np.asarray(batch.tokens_BT)[hinted])
    # Rank blocks carry (nearly) equal attention work; first-fit order alone does not.
    work = row_attention_lengths(np.asarray(batch.segment_ids_BT)) ** 2
    per_rank = work.reshape(4, -1).sum(axis=1)
    unbalanced = groups_to_batch(loaded, seq_len=256, row_multiple=1, min_rows=rows)
    plain = (row_attention_lengths(np.asarray(unbalanced.segment_ids_BT)) ** 2).reshape(4, -1)
    assert per_rank.max() / per_rank.mean() <= plain.sum(axis=1).max() / plain.sum(axis=1).mean()
    assert per_rank.max() / per_rank.mean() < 1.1
    # The reordering moves whole rows: every per-row field of the balanced batch is the same
    # field of the unbalanced one under one row permutation (a field left out of the reorder
    # would pair a row's tokens with another row's log-probs or versions).
    per_row = {
        f.name: (np.asarray(getattr(batch, f.name)), np.asarray(getattr(unbalanced, f.name)))
        for f in dataclasses.fields(batch)
        if f.name.endswith("_BT")
        and getattr(batch, f.name) is not None
        and not f.name.startswith("teacher_")  # the hinted rows: a row set of their own
    }
    per_row["teacher_index_BT"] = (  # indexes the hinted rows by value: moves with its row
        np.asarray(batch.teacher_index_BT),
        np.asarray(unbalanced.teacher_index_BT),
    )
    assert {"sampler_logprobs_BT", "policy_versions_BT", "kinds_BT"} <= set(per_row)
    key = ("tokens_BT", "positions_BT", "segment_ids_BT", "sample_index_BT")
    unused = list(range(rows))
    order = []
    for row in range(rows):
        match = next(
            j for j in unused if all((per_row[k][0][row] == per_row[k][1][j]).all() for k in key)
        )
        unused.remove(match)
        order.append(match)
    for name, (balanced_field, plain_field) in per_row.items():
        np.testing.assert_array_equal(balanced_field, plain_field[order], err_msg=name)
    np.testing.assert_array_equal(
        batch.router_indices_LBTK, np.asarray(unbalanced.router_indices_LBTK)[:, order]
    )


def test_total_rewards_do_not_depend_on_the_padding_it_picks():
    """Dynamic sampling packs each group to a power of two: the totals are those of the group
    packed to its longest sequence (what the trainer computes, padding aside)."""
    rng = np.random.default_rng(1)
    group, _ = _group(rng, "g", [[37], [90, 21], [61], [130]])
    cfg = RLConfig(objective=RLObjectiveConfig(length_penalty_coef=0.05, length_penalty_k=0.01))
    batch = groups_to_batch(
        [group], seq_len=130, reward_weights=reward_weights(cfg.agent.behaviour_rewards)
    )
    expected, _ = sample_rewards(batch, cfg.objective)
    got = total_rewards(group, cfg)
    np.testing.assert_allclose(got, np.asarray(expected)[:4], rtol=1e-6)
    assert np.ptp(got) > 0


def test_an_abandoned_sample_stays_out_of_its_groups_advantages(tmp_path):
    """A sample whose environment failed for good scores 0, but it is nothing the policy did:
    read back from the ledger and packed, it has no advantage and no place in the baseline, so
    three solved samples beside it get 0 (not +0.25 each, and -0.75 for it), and dynamic
    sampling sees a group of equal rewards. The same rewards without the abandonment teach."""
    rng = np.random.default_rng(2)

    def group(gid, abandoned):
        samples = [EpisodeOutcome([_sequence(rng, i, 40)], reward=1.0) for i in range(3)]
        last = EpisodeOutcome([_sequence(rng, 3, 40)], 0.0, truncated=True, abandoned=abandoned)
        ledger = GroupLedger(tmp_path)
        ledger.add(make_group(gid, f"task-{gid}", [*samples, last]))
        return ledger.load(gid)

    rl = RLConfig()
    failed, played = group("failed", True), group("played", False)
    batch = groups_to_batch([failed, played], seq_len=64)
    np.testing.assert_array_equal(batch.group_id_N, [0, 0, 0, -1, 1, 1, 1, 1])
    advantages = group_advantages(batch.rewards_N["task"], batch.group_id_N, "mean")
    np.testing.assert_array_equal(advantages, [0, 0, 0, 0, 0.25, 0.25, 0.25, -0.75])
    np.testing.assert_array_equal(failed.advantages, 0)
    assert is_uniform(failed, rl) and not is_uniform(played, rl)
    # A group recorded before samples could be abandoned trains all of them.
    del played.metadata["abandoned"]
    np.testing.assert_array_equal(groups_to_batch([played], seq_len=64).group_id_N, [0] * 4)
