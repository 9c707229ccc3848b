"""AdamW with linear warmup, cosine decay, per-phase learning-rate scales and global-norm clipping."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from composer_jax.config import OptimizerConfig


def learning_rate_schedule(
    cfg: OptimizerConfig,
    total_steps: int,
    phase_lengths: Sequence[int] = (),
    phase_scales: Sequence[float] = (),
) -> optax.Schedule:
    """Warmup then cosine to min_lr_ratio * peak over the whole run, times the current phase's scale."""
    decay = max(total_steps - cfg.warmup_steps, 1)
    cosine = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.warmup_steps + decay,
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )
    if not phase_lengths:
        return cosine
    ends = jnp.cumsum(jnp.asarray(phase_lengths, jnp.int32))
    scales = jnp.asarray(phase_scales, jnp.float32)

    def schedule(count):
        phase = jnp.minimum(jnp.searchsorted(ends, count, side="right"), len(phase_scales) - 1)
        return cosine(count) * scales[phase]

    return schedule


def _decay_mask(params):
    """Weight decay on matrices only: norms' scales and other vectors are left alone."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(
            schedule,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=_decay_mask,
        ),
    )
