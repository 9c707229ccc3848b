"""Optimizers and schedules."""

from composer_jax.optim.adamw import learning_rate_schedule, make_optimizer

__all__ = ["learning_rate_schedule", "make_optimizer"]
