"""QK-clip (Kimi K2's MuonClip) for MLA: per-head rescaling of the query / key projections.

Muon has no per-coordinate normalisation to keep attention logits bounded; after an update, every
head whose largest pre-softmax logit S_h (softmax scale included) exceeded the threshold tau gets
gamma_h = tau / S_h folded into its weights. In MLA a logit is q_nope . k_nope + q_rope . k_rope
where k_rope is shared by all heads, so the head-specific parts are scaled as: q_nope and k_nope
columns by sqrt(gamma_h), q_rope columns by gamma_h, k_rope and the values untouched. Every logit
of head h then scales by exactly gamma_h: its maximum becomes tau. As in K2, the maxima are the
step's own forward pass's (each attention reports them: `ForwardOutput.attention_max_logits`)
and the scaling applies to the weights after the optimizer's update (`train.step.update_params`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import ModelConfig, OptimizerConfig


def clip_factors(max_logits_H: jax.Array, threshold: float) -> jax.Array:
    """gamma per head: tau / S_h where S_h > tau, else 1."""
    safe = jnp.maximum(max_logits_H, threshold)
    return jnp.where(max_logits_H > threshold, threshold / safe, 1.0)


def qk_clip(
    q_proj_RHK: jax.Array,
    kv_b_proj_RHK: jax.Array,
    max_logits_H: jax.Array,
    threshold: float,
    qk_nope_head_dim: int,
) -> tuple[jax.Array, jax.Array]:
    """Rescaled (query projection, kv_b projection) of one MLA, or of a stack of them.

    q_proj is q_b_proj [..., q_lora, heads, nope + rope] (or q_proj [..., embed, heads, ...]),
    kv_b_proj [..., kv_lora, heads, nope + v]; max_logits [..., heads] with the same leading
    (layer) dims.
    """
    gamma = clip_factors(max_logits_H.astype(jnp.float32), threshold)[..., None, :, None]
    root = jnp.sqrt(gamma)
    nope = qk_nope_head_dim
    q_cols = jnp.arange(q_proj_RHK.shape[-1])
    q_scale = jnp.where(q_cols < nope, root, gamma)
    kv_cols = jnp.arange(kv_b_proj_RHK.shape[-1])
    kv_scale = jnp.where(kv_cols < nope, root, 1.0)
    return (
        (q_proj_RHK * q_scale).astype(q_proj_RHK.dtype),
        (kv_b_proj_RHK * kv_scale).astype(kv_b_proj_RHK.dtype),
    )


def attention_params(params: nnx.State, path: str) -> nnx.State:
    """The parameters of the attention at `path` ("moe_layers/attn", "mtp/0/block/attn")."""
    for part in path.split("/"):
        params = params[int(part) if part.isdigit() else part]
    return params


@dataclasses.dataclass(frozen=True)
class QKClip:
    """QK-clip over a model's parameter state: every attention in `max_logits` (keyed by its
    parameters' path, "moe_layers/attn") gets its over-threshold heads rescaled."""

    threshold: float
    qk_nope_head_dim: int

    @classmethod
    def of(cls, optim: OptimizerConfig, model: ModelConfig) -> QKClip | None:
        """The run's QK-clip, None where `optim.qk_clip_threshold` is 0 (off)."""
        if not optim.qk_clip_threshold:
            return None
        return cls(optim.qk_clip_threshold, model.qk_nope_head_dim)

    def __call__(
        self, params: nnx.State, max_logits: dict[str, jax.Array]
    ) -> tuple[nnx.State, jax.Array]:
        """(`params` with the projections rescaled in place, the number of heads clipped).
        Meant for the fresh state an optimizer update returns inside a traced step."""
        clipped = jnp.zeros((), jnp.int32)
        for path, max_logits_H in max_logits.items():
            attn = attention_params(params, path)
            q_name = "q_b_proj" if "q_b_proj" in attn else "q_proj"
            q, kv = qk_clip(
                attn[q_name][...],
                attn["kv_b_proj"][...],
                max_logits_H,
                self.threshold,
                self.qk_nope_head_dim,
            )
            attn[q_name][...], attn["kv_b_proj"][...] = q, kv
            clipped += jnp.sum(max_logits_H > self.threshold)
        return params, clipped
