"""Pretraining step, loop, metrics, checkpointing, and runs read back (`load_run`)."""

from composer_jax.train.checkpoint import Checkpointer, CheckpointError
from composer_jax.train.loop import (
    NonFiniteLossError,
    PretrainResult,
    Run,
    load_run,
    run_pretraining,
)
from composer_jax.train.metrics import MetricsWriter, read_metrics
from composer_jax.train.step import TrainState, eval_step, pretrain_loss, train_step

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "MetricsWriter",
    "NonFiniteLossError",
    "PretrainResult",
    "Run",
    "TrainState",
    "eval_step",
    "load_run",
    "pretrain_loss",
    "read_metrics",
    "run_pretraining",
    "train_step",
]
