"""Pretraining step, loop, metrics and checkpointing."""

from composer_jax.train.checkpoint import Checkpointer, CheckpointError
from composer_jax.train.loop import NonFiniteLossError, PretrainResult, run_pretraining
from composer_jax.train.metrics import MetricsWriter, read_metrics
from composer_jax.train.step import TrainState, eval_step, pretrain_loss, train_step

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "MetricsWriter",
    "NonFiniteLossError",
    "PretrainResult",
    "TrainState",
    "eval_step",
    "pretrain_loss",
    "read_metrics",
    "run_pretraining",
    "train_step",
]
