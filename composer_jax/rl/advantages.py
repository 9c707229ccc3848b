"""Group-relative advantages (Dr. GRPO by default) and the sample <-> token plumbing.

The baseline is the mean reward of the prompt's group; dividing by the group's std is only an
ablation switch, because it amplifies differences in groups whose rewards barely differ and
reweights prompts by their difficulty. Group ids lie in [0, N) (at most one group per sample);
-1 marks an empty sample slot, whose advantage is 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def per_sample_sum(values_BT: jax.Array, sample_index_BT: jax.Array, num_samples: int) -> jax.Array:
    """Sum of per-token values over each sample's tokens (padding, index -1, is dropped)."""
    valid = sample_index_BT >= 0
    return jax.ops.segment_sum(
        jnp.where(valid, values_BT, 0).reshape(-1),
        jnp.where(valid, sample_index_BT, 0).reshape(-1),
        num_segments=num_samples,
    )


def to_tokens(values_N: jax.Array, sample_index_BT: jax.Array) -> jax.Array:
    """Per-sample values broadcast to each sample's tokens (0 on padding)."""
    valid = sample_index_BT >= 0
    return jnp.where(valid, values_N[jnp.where(valid, sample_index_BT, 0)], 0)


def group_advantages(
    rewards_N: jax.Array, group_id_N: jax.Array, mode: str = "mean", std_eps: float = 1e-6
) -> jax.Array:
    """Advantages of one epoch of samples: reward minus the group baseline.

    "mean": R_i - mean_j R_j. "leave_one_out": R_i - mean_{j != i} R_j, an unbiased baseline
    (= G / (G - 1) times the "mean" advantage). "mean_std": the "mean" advantage divided by the
    group's std + std_eps. A group of one sample gets 0.
    """
    N = rewards_N.shape[0]
    valid = group_id_N >= 0
    group = jnp.where(valid, group_id_N, 0)
    weight = valid.astype(jnp.float32)
    raw = jnp.where(valid, rewards_N.astype(jnp.float32), -jnp.inf)
    # Centred on the group's largest reward first, which changes no advantage but makes a group
    # of equal rewards exactly 0 in every mode: a float32 mean of equal values need not equal
    # them, and "mean_std" would blow the rounding up to a push of the whole group.
    top = jax.ops.segment_max(raw, group, num_segments=N)[group]
    rewards = jnp.where(valid, raw - top, 0.0)

    def group_sum(x):
        return jax.ops.segment_sum(x * weight, group, num_segments=N)[group]

    count = group_sum(jnp.ones_like(rewards))
    total = group_sum(rewards)
    mean = total / jnp.maximum(count, 1.0)
    if mode == "leave_one_out":
        others = jnp.maximum(count - 1.0, 1.0)
        advantages = jnp.where(count > 1, rewards - (total - rewards) / others, 0.0)
    elif mode in ("mean", "mean_std"):
        advantages = rewards - mean
        if mode == "mean_std":
            variance = group_sum((rewards - mean) ** 2) / jnp.maximum(count, 1.0)
            advantages = advantages / (jnp.sqrt(variance) + std_eps)
    else:
        raise ValueError(f"unknown advantage mode {mode!r}")
    return jnp.where(valid, advantages, 0.0)
