"""RL: trajectory batches, group advantages, KL, length penalty, distillation, router replay; the
rollout collection (engine + environments -> packed groups), the group ledger and the
compressed-delta weight sync; the asynchronous actor loop's roles (Coordinator, RLTrainer,
Sampler, environment pools, Evaluator). `composer_jax.rl.run.run_rl` runs it all."""

from composer_jax.rl.advantages import group_advantages, per_sample_sum, to_tokens
from composer_jax.rl.batch import SegmentKind, Sequence, TrajectoryBatch, pack_trajectories
from composer_jax.rl.config import RLConfig, RLObjectiveConfig, validate_rl, validate_rl_objective
from composer_jax.rl.coordinator import Coordinator, RolloutFailedError
from composer_jax.rl.env_workers import (
    EnvironmentPool,
    EnvWorkerError,
    ProcessEnvironmentPool,
    RayEnvironmentPool,
    ThreadEnvironmentPool,
    make_environment_pool,
)
from composer_jax.rl.evaluator import Evaluator, HeldoutResult
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
from composer_jax.rl.sampler import LocalSampler, Sampler
from composer_jax.rl.samples import SampleResult, group_sequences, groups_to_batch, make_group
from composer_jax.rl.trainer import NonFiniteRLLossError, RLTrainer, rl_train_step
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
    "Coordinator",
    "EnvWorkerError",
    "EnvironmentPool",
    "Evaluator",
    "HeldoutResult",
    "LocalSampler",
    "NonFiniteRLLossError",
    "ProcessEnvironmentPool",
    "RLConfig",
    "RLTrainer",
    "RayEnvironmentPool",
    "RolloutFailedError",
    "SampleResult",
    "Sampler",
    "ThreadEnvironmentPool",
    "group_sequences",
    "groups_to_batch",
    "make_environment_pool",
    "make_group",
    "rl_train_step",
    "validate_rl",
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
