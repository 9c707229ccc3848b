"""The RL objective, pure functions over trajectory batches: group advantages, KL estimators, the
length penalty and reward components, the policy-gradient and distillation losses, router
replay on the model. Nothing of the actor loop (that is `composer_jax.actor`)."""

from composer_jax.rl.advantages import group_advantages, per_sample_sum, to_tokens
from composer_jax.rl.batch import SegmentKind, Sequence, TrajectoryBatch, pack_trajectories
from composer_jax.rl.config import RLObjectiveConfig, validate_rl_objective
from composer_jax.rl.kl import exact_kl, kl_estimate
from composer_jax.rl.length_penalty import (
    LENGTH_FEATURES,
    length_features,
    length_penalty,
    sample_rewards,
)
from composer_jax.rl.loss import (
    distillation_token_kl,
    loss_normalizer,
    policy_gradient_token_loss,
    policy_objective,
    token_logprobs,
    trainable_mask,
)
from composer_jax.rl.policy import (
    reference_logits,
    reference_logprobs,
    rl_loss,
    teacher_logits,
    trainer_logits,
)

__all__ = [
    "LENGTH_FEATURES",
    "RLObjectiveConfig",
    "SegmentKind",
    "Sequence",
    "TrajectoryBatch",
    "distillation_token_kl",
    "exact_kl",
    "group_advantages",
    "kl_estimate",
    "length_features",
    "length_penalty",
    "loss_normalizer",
    "pack_trajectories",
    "per_sample_sum",
    "policy_gradient_token_loss",
    "policy_objective",
    "reference_logits",
    "reference_logprobs",
    "rl_loss",
    "sample_rewards",
    "teacher_logits",
    "to_tokens",
    "token_logprobs",
    "trainable_mask",
    "trainer_logits",
    "validate_rl_objective",
]
