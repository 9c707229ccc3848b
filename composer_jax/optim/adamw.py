"""Schedules (warm-up, cosine or warmup-stable-decay, per-phase scales) and the optimizer factory:
AdamW or Muon + AdamW."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import optax

from composer_jax.config import OptimizerConfig
from composer_jax.optim.muon import decay_mask, muon, split_table


def learning_rate_schedule(
    cfg: OptimizerConfig,
    total_steps: int,
    phase_lengths: Sequence[int] = (),
    phase_scales: Sequence[float] = (),
) -> optax.Schedule:
    """Linear warm-up, then cfg.schedule's decay to min_lr_ratio * peak by the end of the run
    ("cosine" over all of it, "wsd" over its last decay_fraction), times the phase's scale."""
    after_warmup = max(total_steps - cfg.warmup_steps, 1)
    decay = after_warmup
    if cfg.schedule == "wsd":
        decay = max(round(cfg.decay_fraction * after_warmup), 1)
    elif cfg.schedule != "cosine":
        raise ValueError(f"optim.schedule: unknown schedule {cfg.schedule!r}")
    base = optax.join_schedules(
        [
            optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps),
            optax.constant_schedule(cfg.learning_rate),
            optax.cosine_decay_schedule(cfg.learning_rate, decay, alpha=cfg.min_lr_ratio),
        ],
        [cfg.warmup_steps, cfg.warmup_steps + after_warmup - decay],
    )
    if not phase_lengths:
        return base
    ends = jnp.cumsum(jnp.asarray(phase_lengths, jnp.int32))
    scales = jnp.asarray(phase_scales, jnp.float32)

    def schedule(count):
        phase = jnp.minimum(jnp.searchsorted(ends, count, side="right"), len(phase_scales) - 1)
        return base(count) * scales[phase]

    return schedule


def make_optimizer(
    cfg: OptimizerConfig,
    schedule: optax.Schedule,
    logical_axes,
    shardings=None,
    verbose: bool = True,
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (`cfg.name="adamw"`) or Muon + AdamW (`"muon"`).

    `logical_axes` (`logical_axes_of(params)`) tell matrices, which alone are decayed, from the
    rest (`decay_mask`); Muon also finds its Newton-Schulz batch axes there, and with the
    parameters' NamedShardings runs the sharded (all-to-all) Newton-Schulz. Muon's learning rate
    follows `schedule` rescaled to peak at `cfg.muon_learning_rate`. With `verbose`, the first
    `init` prints which parameter gets what.
    """
    clip = optax.clip_by_global_norm(cfg.clip_norm)
    if cfg.name == "adamw":
        return optax.chain(
            clip,
            optax.adamw(
                schedule,
                b1=cfg.b1,
                b2=cfg.b2,
                eps=cfg.eps,
                weight_decay=cfg.weight_decay,
                mask=decay_mask(logical_axes),
            ),
        )
    if cfg.name != "muon":
        raise ValueError(f"optim.name: unknown optimizer {cfg.name!r}")
    ratio = cfg.muon_learning_rate / cfg.learning_rate
    tx = optax.chain(
        clip,
        muon(
            lambda count: schedule(count) * ratio,
            logical_axes,
            shardings=shardings,
            beta=cfg.muon_momentum,
            nesterov=cfg.muon_nesterov,
            ns_steps=cfg.muon_ns_steps,
            scaling=cfg.muon_scaling,
            weight_decay=cfg.weight_decay,
            adam_learning_rate=schedule,
            adam_b1=cfg.b1,
            adam_b2=cfg.b2,
            adam_eps=cfg.eps,
            adam_weight_decay=cfg.weight_decay,
        ),
    )
    if not verbose:
        return tx
    printed = []

    def init(params):
        if not printed:
            print(split_table(params, logical_axes, shardings), flush=True)
            printed.append(True)
        return tx.init(params)

    return optax.GradientTransformation(init, tx.update)
