"""Typed experiment configuration: frozen dataclasses are the source of truth.

`launch/` turns these into `ml_collections.ConfigDict`s so every field can be overridden from the
command line (`--config.model.num_layers=4`), then rebuilds the dataclasses with `from_dict`, which
rejects unknown fields and wrong types, and `validate`, which rejects contradictory values. Both
name the offending field and run before anything is compiled. By concern: `model` (model and
mesh), `training` (optimizer, data, phases), `rl` (the objective, rollout, agent and held-out sections), `experiment` (the
whole and its checks), `base` (errors and conversion). Presets live in `composer_jax.presets`
(which imports this package; nothing here imports it). The tokenizer a config names is checked
where it is loaded (`train.runs.resolve_tokenizer`): configs know no tokenizer.
"""

from composer_jax.config.base import ConfigError, field_paths, from_dict, to_dict
from composer_jax.config.experiment import (
    RESUME_POLICIES,
    ExperimentConfig,
    fitted_mesh,
    phase_steps,
    validate,
)
from composer_jax.config.model import (
    EXPERT_BACKENDS,
    EXPERT_GEMM_IMPLS,
    EXPERT_PRECISIONS,
    LONG_CONTEXT_ATTENTION_BLOCK,
    PLANNED_EXPERT_CAPACITY,
    MeshConfig,
    ModelConfig,
    YarnConfig,
    ep_group_size,
    mesh_shape,
    validate_model,
)
from composer_jax.config.rl import (
    ADVANTAGE_MODES,
    ENV_WORKER_KINDS,
    IMPORTANCE_WEIGHTINGS,
    KL_ESTIMATORS,
    KL_PLACEMENTS,
    RL_BACKENDS,
    STALE_POLICIES,
    AgentConfig,
    HeldoutConfig,
    RLConfig,
    RLObjectiveConfig,
    RolloutConfig,
    validate_rl,
    validate_rl_objective,
)
from composer_jax.config.training import (
    LR_SCHEDULES,
    DataConfig,
    LogConfig,
    OptimizerConfig,
    PhaseConfig,
    TrainConfig,
)

__all__ = [
    "ADVANTAGE_MODES",
    "ENV_WORKER_KINDS",
    "EXPERT_BACKENDS",
    "EXPERT_GEMM_IMPLS",
    "EXPERT_PRECISIONS",
    "IMPORTANCE_WEIGHTINGS",
    "KL_ESTIMATORS",
    "KL_PLACEMENTS",
    "LONG_CONTEXT_ATTENTION_BLOCK",
    "LR_SCHEDULES",
    "PLANNED_EXPERT_CAPACITY",
    "RESUME_POLICIES",
    "RL_BACKENDS",
    "STALE_POLICIES",
    "AgentConfig",
    "ConfigError",
    "DataConfig",
    "ExperimentConfig",
    "HeldoutConfig",
    "MeshConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PhaseConfig",
    "RLConfig",
    "RLObjectiveConfig",
    "RolloutConfig",
    "TrainConfig",
    "LogConfig",
    "YarnConfig",
    "fitted_mesh",
    "from_dict",
    "ep_group_size",
    "mesh_shape",
    "phase_steps",
    "to_dict",
    "field_paths",
    "validate",
    "validate_model",
    "validate_rl",
    "validate_rl_objective",
]
