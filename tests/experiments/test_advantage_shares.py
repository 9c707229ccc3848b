"""experiments/advantage_shares.py on a hand-made run folder: the pooled share of the advantage
of each reward part, over the trained groups only (and their samples in the advantages: not an
abandoned one), against numpy."""

import dataclasses
import json

import numpy as np
import pytest

from composer_jax import config as config_lib
from composer_jax import presets
from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.samples import make_group
from composer_jax.agent import EpisodeOutcome
from experiments import advantage_shares
from tests.helpers import policy_sequence


def _episode(rng, reward, style, abandoned=False):
    turns = int(rng.integers(1, 6))
    return EpisodeOutcome(
        [policy_sequence(rng, 4, int(rng.integers(4, 26)))],
        reward=reward,
        num_turns=turns,
        num_tool_calls=turns,
        behaviour={"style": style},
        abandoned=abandoned,
    )


def test_shares_pool_the_trained_groups_and_match_numpy(tmp_path):
    rng = np.random.default_rng()
    cfg = presets.PRESETS["rl_tiny"]()
    cfg = dataclasses.replace(
        cfg,
        rl=dataclasses.replace(
            cfg.rl, agent=dataclasses.replace(cfg.rl.agent, behaviour_rewards=("style=0.1",))
        ),
    )
    (tmp_path / "config.json").write_text(json.dumps(config_lib.to_dict(cfg)))
    ledger = GroupLedger(str(tmp_path / "ledger"))
    # g0's last sample was abandoned (its environment failed): its 0 is no task signal.
    task = [[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.5], [1.0, 0.0, 0.0, 0.0]]
    style = -rng.uniform(0, 1, (3, 4))
    for g in range(3):
        abandoned = [g == 0 and i == 3 for i in range(4)]
        episodes = [_episode(rng, task[g][i], style[g, i], abandoned[i]) for i in range(4)]
        ledger.add(make_group(f"g{g}", f"p{g}", episodes))
    ledger.mark_trained(["g0", "g1"], 1)  # g2 was never trained: not counted

    shares = advantage_shares.run_shares(str(tmp_path))

    def pooled(parts):
        centred = [p - np.mean(p) for p in parts]
        return np.sqrt(np.mean(np.concatenate(centred) ** 2))

    assert shares["groups"] == 2 and shares["task_signal"] == pytest.approx(0.5)
    rms = shares["advantage_rms"]
    played = [np.array(task[0][:3]), np.array(task[1])]
    assert rms["task"] == pytest.approx(pooled(played), rel=1e-5)
    assert rms["style"] == pytest.approx(pooled([0.1 * style[0, :3], 0.1 * style[1]]), rel=1e-5)
    assert rms["length_penalty"] > 0
