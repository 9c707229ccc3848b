"""Optimizers and schedules."""

from composer_jax.optim.adamw import learning_rate_schedule, make_optimizer
from composer_jax.optim.muon import (
    matrix_layout,
    muon,
    newton_schulz,
    orthogonalize,
    scale_by_muon,
    split_table,
)
from composer_jax.optim.qk_clip import QKClip, clip_factors, qk_clip
from composer_jax.optim.sharding import shard_like_params

__all__ = [
    "QKClip",
    "clip_factors",
    "learning_rate_schedule",
    "make_optimizer",
    "matrix_layout",
    "muon",
    "newton_schulz",
    "orthogonalize",
    "qk_clip",
    "scale_by_muon",
    "shard_like_params",
    "split_table",
]
