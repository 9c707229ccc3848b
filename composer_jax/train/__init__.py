"""Pretraining step, loop, metrics, checkpointing, run folders (`RunFolder`), and runs read back
(`load_run`).

The loop's names are imported on first use (PEP 562): the loop brings the data pipeline and its
`grain`, which the train step alone does not need, so the step runs where grain is missing (the
lent GPU machine's image: experiments/gpu_check.py)."""

import importlib

from composer_jax.train.checkpoint import Checkpointer, CheckpointError
from composer_jax.train.metrics import MetricsWriter, read_metrics
from composer_jax.train.run_folder import RunFolder
from composer_jax.train.step import TrainState, eval_step, pretrain_loss, train_step

_FROM_LOOP = ("NonFiniteLossError", "PretrainResult", "Run", "load_run", "run_pretraining")


def __getattr__(name: str):
    if name in _FROM_LOOP:
        return getattr(importlib.import_module("composer_jax.train.loop"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "Checkpointer",
    "MetricsWriter",
    "NonFiniteLossError",
    "PretrainResult",
    "Run",
    "RunFolder",
    "TrainState",
    "eval_step",
    "load_run",
    "pretrain_loss",
    "read_metrics",
    "run_pretraining",
    "train_step",
]
