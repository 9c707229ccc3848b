"""RLObjectiveConfig validation names the field at fault."""

import dataclasses

import pytest

from composer_jax.config import ConfigError, from_dict
from composer_jax.rl import RLObjectiveConfig, validate_rl_objective


def test_defaults_are_valid_and_round_trip():
    cfg = RLObjectiveConfig()
    validate_rl_objective(cfg)
    assert (cfg.kl_estimator, cfg.kl_placement, cfg.advantage_mode) == ("k1", "in_reward", "mean")
    rebuilt = from_dict(RLObjectiveConfig, dataclasses.asdict(cfg), "rl")
    assert rebuilt == cfg


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"kl_estimator": "k4"}, "rl.objective.kl_estimator"),
        ({"kl_placement": "in_advantage"}, "rl.objective.kl_placement"),
        (
            {"kl_estimator": "exact"},
            "rl.objective.kl_placement",
        ),  # exact KL with the default in_reward
        ({"importance_weighting": "clip"}, "rl.objective.importance_weighting"),
        ({"advantage_mode": "std"}, "rl.objective.advantage_mode"),
        ({"kl_coef": -0.1}, "rl.objective.kl_coef"),
        ({"importance_cap": 0.0}, "rl.objective.importance_cap"),
        ({"clip_eps_low": 1.0}, "rl.objective.clip_eps_low"),
        ({"length_penalty_k": 0.0}, "rl.objective.length_penalty_k"),
        ({"length_weight_tool_output": -1.0}, "rl.objective.length_weight_tool_output"),
        ({"max_generation_len": 0}, "rl.objective.max_generation_len"),
    ],
)
def test_invalid_values_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate_rl_objective(dataclasses.replace(RLObjectiveConfig(), **changes))
    validate_rl_objective(
        dataclasses.replace(RLObjectiveConfig(), kl_estimator="exact", kl_placement="in_loss")
    )
