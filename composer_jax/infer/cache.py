"""MLA latent KV cache and cached attention.

The cache stores what `MLA.latents` produces per token and layer: the normed KV latent
(kv_lora_rank) and the shared rotary key (qk_rope_head_dim), never full per-head keys and values.
Rows are slots: each running sequence owns one slot, and a token's position is its index in the
row, so sequences of different lengths share one fixed-shape array. Stale entries beyond a
sequence's length are never read: a query at position p only sees keys at positions <= p, and a
chunk writes its latents before it attends.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from composer_jax.config import ModelConfig
from composer_jax.model import rope
from composer_jax.model.attention import MLA, attention_probs
from composer_jax.model.layers import dtype_of


class LatentCache(NamedTuple):
    c_kv_LNSR: jax.Array  # normed kv latents [layers, slots, max_len, kv_lora_rank]
    k_rope_LNSK: jax.Array  # rotary keys [layers, slots, max_len, qk_rope_head_dim]


def init_cache(cfg: ModelConfig, layers: int, slots: int, max_len: int) -> LatentCache:
    dt = dtype_of(cfg.dtype)
    return LatentCache(
        jnp.zeros((layers, slots, max_len, cfg.kv_lora_rank), dt),
        jnp.zeros((layers, slots, max_len, cfg.qk_rope_head_dim), dt),
    )


def cache_bytes_per_token(cfg: ModelConfig, layers: int | None = None) -> int:
    """Latent cache bytes per token: (kv_lora_rank + qk_rope_head_dim) * layers * bytes."""
    layers = cfg.num_layers if layers is None else layers
    return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * layers * dtype_of(cfg.dtype).itemsize


def full_kv_bytes_per_token(cfg: ModelConfig, layers: int | None = None) -> int:
    """What a conventional cache of per-head keys and values would hold per token."""
    layers = cfg.num_layers if layers is None else layers
    per_head = cfg.qk_head_dim + cfg.v_head_dim
    return cfg.num_heads * per_head * layers * dtype_of(cfg.dtype).itemsize


def absorbed_attend(
    attn: MLA,
    q_nope_BTHK: jax.Array,
    q_rope_BTHK: jax.Array,
    c_kv_BSR: jax.Array,
    k_rope_BSK: jax.Array,
    mask_BTS: jax.Array,
) -> jax.Array:
    """`MLA.attend` with the K up-projection folded into the query and the V up-projection applied
    after the weighted sum, so attention runs in the latent space and keys/values are never
    expanded per head: O(S * R) per head instead of O(S * R * head_dim) to build K/V."""
    cfg, dt = attn.cfg, q_nope_BTHK.dtype
    w_uk_RHK, w_uv_RHV = jnp.split(attn.kv_b_proj[...].astype(dt), [cfg.qk_nope_head_dim], axis=-1)
    q_latent_BTHR = jnp.einsum("bthk,rhk->bthr", q_nope_BTHK, w_uk_RHK)
    scores = jnp.einsum(
        "bthr,bsr->bhts", q_latent_BTHR, c_kv_BSR, preferred_element_type=jnp.float32
    ) + jnp.einsum("bthk,bsk->bhts", q_rope_BTHK, k_rope_BSK, preferred_element_type=jnp.float32)
    probs = attention_probs(scores, mask_BTS, cfg, dt)
    # The weighted sum as [B, H*T, S] @ [B, S, R]: XLA:CPU lowers the same einsum written over
    # (b, h, t, s) to a slow bf16 dot (2.6 ms against 0.09 ms at 32 slots x 512 positions).
    B, H, T, S = probs.shape
    out_latent_BHTR = jnp.matmul(probs.reshape(B, H * T, S), c_kv_BSR).reshape(B, H, T, -1)
    out_BTHV = jnp.einsum("bhtr,rhv->bthv", out_latent_BHTR, w_uv_RHV)
    return jnp.einsum("bthv,hvd->btd", out_BTHV, attn.o_proj[...].astype(dt))


def cached_attention(
    attn: MLA,
    x_BTD: jax.Array,
    positions_BT: jax.Array,
    valid_BT: jax.Array,
    c_kv_BSR: jax.Array,
    k_rope_BSK: jax.Array,
    absorbed: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Writes the chunk's latents at its positions, then attends causally over the cache rows.

    Invalid (padding) tokens write nowhere. Returns (output [B,T,D], c_kv, k_rope).
    """
    cos, sin = rope.rope_tables(positions_BT, attn.cfg)
    q_nope, q_rope = attn.queries(x_BTD, cos, sin)
    c_new_BTR, k_new_BTK = attn.latents(x_BTD, cos, sin)
    S = c_kv_BSR.shape[1]
    write_BT = jnp.where(valid_BT, positions_BT, S)  # out of range: dropped
    rows_B1 = jnp.arange(x_BTD.shape[0])[:, None]
    c_kv_BSR = c_kv_BSR.at[rows_B1, write_BT].set(c_new_BTR.astype(c_kv_BSR.dtype), mode="drop")
    k_rope_BSK = k_rope_BSK.at[rows_B1, write_BT].set(
        k_new_BTK.astype(k_rope_BSK.dtype), mode="drop"
    )
    mask_BTS = jnp.arange(S)[None, None, :] <= positions_BT[:, :, None]
    c_kv, k_rope = c_kv_BSR.astype(x_BTD.dtype), k_rope_BSK.astype(x_BTD.dtype)
    if absorbed:
        out = absorbed_attend(attn, q_nope, q_rope, c_kv, k_rope, mask_BTS)
    else:
        out = attn.attend(q_nope, q_rope, c_kv, k_rope, mask_BTS)
    return out, c_kv_BSR, k_rope_BSK
