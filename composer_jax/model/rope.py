"""Rotary position embeddings with optional YaRN scaling (DeepSeek-V3 variant).

Pairs are rotated in interleaved layout: (x[2i], x[2i+1]) by angle pos * inv_freq[i]. Hugging Face's
DeepSeek-V3 de-interleaves before a rotate-half rotation; that permutes q and k identically, so the
attention scores are the same.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.config import ModelConfig, YarnConfig


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def inverse_frequencies(dim: int, theta: float, yarn: YarnConfig | None) -> np.ndarray:
    """Per-pair angular frequencies, blending interpolated and original ones under YaRN."""
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    extrapolation = 1.0 / theta**exponents
    if yarn is None:
        return extrapolation.astype(np.float32)
    interpolation = extrapolation / yarn.factor
    low = math.floor(
        _yarn_correction_dim(yarn.beta_fast, dim, theta, yarn.original_max_position_embeddings)
    )
    high = math.ceil(
        _yarn_correction_dim(yarn.beta_slow, dim, theta, yarn.original_max_position_embeddings)
    )
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # Avoid a zero-width ramp.
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep_original = 1.0 - ramp
    inv = interpolation * (1.0 - keep_original) + extrapolation * keep_original
    return inv.astype(np.float32)


def rope_attention_factor(yarn: YarnConfig | None) -> float:
    """YaRN's magnitude correction applied to cos/sin."""
    if yarn is None:
        return 1.0
    return yarn_get_mscale(yarn.factor, yarn.mscale) / yarn_get_mscale(
        yarn.factor, yarn.mscale_all_dim
    )


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = cfg.qk_head_dim**-0.5
    if cfg.rope_scaling is not None and cfg.rope_scaling.mscale_all_dim:
        m = yarn_get_mscale(cfg.rope_scaling.factor, cfg.rope_scaling.mscale_all_dim)
        scale = scale * m * m
    return scale


def rope_tables(positions_BT: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin, float32 [B, T, rope_dim/2]."""
    inv = jnp.asarray(inverse_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling))
    angles = positions_BT.astype(jnp.float32)[..., None] * inv
    factor = rope_attention_factor(cfg.rope_scaling)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x: jax.Array, cos_BTK: jax.Array, sin_BTK: jax.Array) -> jax.Array:
    """Rotates interleaved pairs of x [B, T, ..., 2K]; cos/sin broadcast over middle axes."""
    extra = x.ndim - 3
    cos = cos_BTK.reshape(cos_BTK.shape[:2] + (1,) * extra + cos_BTK.shape[2:])
    sin = sin_BTK.reshape(sin_BTK.shape[:2] + (1,) * extra + sin_BTK.shape[2:])
    pairs = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)
