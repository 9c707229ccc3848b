"""RL: trajectory batches, group advantages, KL, length penalty, distillation, router replay; the
rollout collection (engine + environments -> packed groups), the group ledger and the
compressed-delta weight sync of the actor loop."""

from composer_jax.rl.advantages import group_advantages, per_sample_sum, to_tokens
from composer_jax.rl.batch import SegmentKind, Sequence, TrajectoryBatch, pack_trajectories
from composer_jax.rl.config import RLObjectiveConfig, validate_rl_objective
from composer_jax.rl.kl import exact_kl, kl_estimate
from composer_jax.rl.ledger import Group, GroupLedger, LedgerError
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
from composer_jax.rl.policy import reference_logprobs, rl_loss, teacher_logits, trainer_logits
from composer_jax.rl.rollout import collect_batch, collect_group
from composer_jax.rl.weight_sync import (
    CorruptShardError,
    LocalDirStore,
    MissingVersionError,
    PublishInfo,
    Store,
    TensorStoreKvStore,
    WeightPublisher,
    WeightSubscriber,
    WeightSyncError,
    open_store,
)

__all__ = [
    "CorruptShardError",
    "Group",
    "GroupLedger",
    "LedgerError",
    "LocalDirStore",
    "MissingVersionError",
    "PublishInfo",
    "Store",
    "TensorStoreKvStore",
    "WeightPublisher",
    "WeightSubscriber",
    "WeightSyncError",
    "open_store",
    "LENGTH_FEATURES",
    "RLObjectiveConfig",
    "SegmentKind",
    "Sequence",
    "TrajectoryBatch",
    "collect_batch",
    "collect_group",
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
