"""Too-stale groups are dropped (and counted) or re-weighted, per `rl.rollout.stale_policy`."""

import dataclasses

import numpy as np
import pytest

from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.samples import make_group
from composer_jax.actor.scheduler import next_groups
from composer_jax.agent import EpisodeOutcome
from composer_jax.config import RLConfig, RolloutConfig
from tests.helpers import policy_sequence


class _Coordinator:
    """The two calls `next_groups` makes: pending groups, and the trained/dropped count."""

    def __init__(self, ledger):
        self.ledger, self.released, self.redone = ledger, 0, []

    def wait_for_groups(self, count, interrupted=None):
        return self.ledger.pending()[:count]

    def groups_trained(self, count, version):
        self.released += count

    def redispatch(self, group_ids):
        self.redone += group_ids


def _sample(version, reward, length=20, rng=None):
    """A one-sequence sample: 4 prompt tokens, then `length` thinking tokens sampled at
    `version` (the first) and later versions."""
    rng = rng or np.random.default_rng(0)
    n = 4 + length
    versions = np.where(np.arange(n) >= 4, version + rng.integers(0, 2, n), 0).astype(np.int32)
    versions[4] = version
    seq = policy_sequence(rng, 4, length, versions)
    return EpisodeOutcome([seq], reward=float(reward), num_turns=1, behaviour={"answered": 0.0})


def _ledger(tmp_path, min_versions, rewards=None, lengths=None):
    ledger = GroupLedger(tmp_path)
    rng = np.random.default_rng(0)
    for i, v in enumerate(min_versions):
        reward = rng.random(2) if rewards is None else rewards[i]
        length = (20, 20) if lengths is None else lengths[i]
        samples = [_sample(v, r, n, rng) for r, n in zip(reward, length)]
        ledger.add(make_group(f"g{i}", f"t{i}", samples))
    return ledger


def test_uniform_groups_are_skipped_when_asked(tmp_path):
    rl = RLConfig(rollout=RolloutConfig(groups_per_step=2, skip_uniform_groups=True))
    rewards = [[0, 0], [1, 0], [1, 1], [0.5, 0.5], [0, 1]]
    ledger = _ledger(tmp_path, [3] * 5, rewards)
    coordinator = _Coordinator(ledger)
    groups, weights, dropped = next_groups(coordinator, ledger, rl, version=3)
    assert [g.group_id for g in groups] == ["g1", "g4"]
    assert ledger.dropped("uninformative") == ["g0", "g2", "g3"]
    assert coordinator.released == 3 and coordinator.redone == [] and dropped == 0


@pytest.mark.parametrize("policy", ["drop", "reweight"])
def test_stale_groups_are_dropped_or_reweighted(tmp_path, policy):
    rl = RLConfig(
        rollout=RolloutConfig(
            groups_per_step=2, max_staleness=2, stale_policy=policy, stale_decay=0.5
        )
    )
    ledger = _ledger(tmp_path, [1, 7, 4, 9, 8])  # trainer at version 9: lags 8, 2, 5, 0, 1
    coordinator = _Coordinator(ledger)
    groups, weights, dropped = next_groups(coordinator, ledger, rl, version=9)
    if policy == "drop":
        assert [g.group_id for g in groups] == ["g1", "g3"]
        assert weights == [1.0, 1.0]
        assert dropped == 2 and coordinator.released == 2
        assert coordinator.redone == ["g0", "g2"]  # their prompts are sampled again
        assert ledger.stats()["dropped_stale"] == 2
    else:
        assert [g.group_id for g in groups] == ["g0", "g1"]
        assert weights == [0.5**6, 1.0]
        assert dropped == 0 and ledger.stats()["dropped_stale"] == 0


@pytest.mark.parametrize(
    "uniform_by, trained, dropped", [("task", "g2", ["g0", "g1"]), ("total", "g1", ["g0"])]
)
def test_dynamic_sampling_compares_the_chosen_reward(tmp_path, uniform_by, trained, dropped):
    """Every sample of g1 passes but the shorter one gets a smaller length penalty: by task reward
    g1 is uniform and skipped like g0; by total reward it still has a signal and is trained. g2
    (one pass, one fail) is trained either way."""
    rl = RLConfig(
        rollout=RolloutConfig(groups_per_step=1, skip_uniform_groups=True, uniform_by=uniform_by)
    )
    rewards = [[1, 1], [1, 1], [1, 0]]
    ledger = _ledger(tmp_path, [3, 3, 3], rewards, lengths=[(20, 20), (10, 300), (20, 20)])
    groups, _, _ = next_groups(_Coordinator(ledger), ledger, rl, version=3)
    assert [g.group_id for g in groups] == [trained]
    assert ledger.dropped("uninformative") == dropped


def test_weights_scale_the_advantages_of_their_samples():
    from composer_jax.rl import RLObjectiveConfig, policy_objective
    from tests.rl.toy import one_step_batch

    rng = np.random.default_rng()
    samples = np.concatenate([rng.permutation(4), rng.permutation(4)])  # rewards differ in both
    sampler_logp, reward = np.log(np.full(4, 0.25)), rng.random(4)
    batch = one_step_batch(samples, sampler_logp, reward, group_size=4)
    logits = np.tile(rng.normal(size=(1, 1, 4)), (8, 2, 1)).astype(np.float32)
    cfg = RLObjectiveConfig(
        kl_coef=0.0, length_penalty_coef=0.0, importance_weighting="none", loss_normalizer=1.0
    )
    _, plain = policy_objective(logits, batch, cfg)
    weighted = dataclasses.replace(batch, sample_weight_N=np.array([0.25] * 4 + [1.0] * 4))
    _, scaled = policy_objective(logits, weighted, cfg)
    half = dataclasses.replace(batch, sample_weight_N=np.array([0.25] * 8, np.float32))
    _, quarter = policy_objective(logits, half, cfg)
    np.testing.assert_allclose(float(quarter["pg_loss"]), 0.25 * float(plain["pg_loss"]), rtol=1e-6)
    # Each group's weight scales its own loss: each group alone, in a batch of its own (the
    # loss normaliser fixed, so sums add up), weighted by hand.
    alone = [
        float(
            policy_objective(
                logits[:4], one_step_batch(samples[g * 4 : g * 4 + 4], sampler_logp, reward, 4), cfg
            )[1]["pg_loss"]
        )
        for g in (0, 1)
    ]
    np.testing.assert_allclose(
        float(scaled["pg_loss"]), 0.25 * alone[0] + alone[1], rtol=1e-5, atol=1e-7
    )


def test_a_damaged_pending_group_is_set_aside_and_its_prompt_redone(tmp_path):
    rl = RLConfig(rollout=RolloutConfig(groups_per_step=2))
    ledger = _ledger(tmp_path, [3, 3, 3])
    path = tmp_path / "groups" / "g0.npz"
    data = bytearray(path.read_bytes())
    data[200] ^= 0xFF  # a flipped byte inside an array
    path.write_bytes(bytes(data))
    coordinator = _Coordinator(ledger)
    groups, weights, dropped = next_groups(coordinator, ledger, rl, version=3)
    assert [g.group_id for g in groups] == ["g1", "g2"]
    assert coordinator.redone == ["g0"] and coordinator.released == 1
    assert ledger.stats()["corrupt"] == 1 and (tmp_path / "groups" / "g0.npz.corrupt").exists()
