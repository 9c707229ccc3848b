"""Settings of the RL objective (DESIGN.md section 6).

They live in `composer_jax.config`, the one home of typed configs, hung under the experiment config
as `rl.*` (`--config.rl.objective.kl_coef=0.01`); re-exported here for the objective's modules.
"""

from composer_jax.config import (
    ADVANTAGE_MODES,
    IMPORTANCE_WEIGHTINGS,
    KL_ESTIMATORS,
    KL_PLACEMENTS,
    RLObjectiveConfig,
    validate_rl_objective,
)

__all__ = [
    "ADVANTAGE_MODES",
    "IMPORTANCE_WEIGHTINGS",
    "KL_ESTIMATORS",
    "KL_PLACEMENTS",
    "RLObjectiveConfig",
    "validate_rl_objective",
]
