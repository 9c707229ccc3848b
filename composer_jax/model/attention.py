"""Multi-head Latent Attention (DeepSeek-V2/V3).

Keys and values are compressed into a per-token latent (kv_lora_rank, RMS-normed) plus one rotary
key part shared by every head. The forward pass is split at the latent so that context parallelism
can all-gather just the latents, and an inference KV cache can store just the latents. Training
attends with one dense [T, S] product per head, or with `model.attention_block_size` set, in key
blocks under an online softmax (`blockwise_attention`: long contexts hold no [T, S] array).
Both report each head's largest visible logit, which QK-clip (`composer_jax.optim.qk_clip`)
reads to rescale the heads whose logits grew past its threshold.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model import rope
from composer_jax.model.layers import RMSNorm, compute_weight, fan_in_param
from composer_jax.model.projection import project
from composer_jax.parallel.mesh import constrain

_MASKED = -1e30
# DeepSeek-V3 normalises the q and kv latents with a fixed epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, pdt = cfg.hidden_size, cfg.num_heads, cfg.param_dtype
        if cfg.q_lora_rank is None:
            self.q_proj = fan_in_param(
                rngs, (d, h, cfg.qk_head_dim), ("embed", "heads", "head_dim"), d, pdt
            )
        else:
            r = cfg.q_lora_rank
            self.q_a_proj = fan_in_param(rngs, (d, r), ("embed", "q_lora"), d, pdt)
            self.q_a_norm = RMSNorm(r, LATENT_NORM_EPS, "q_lora", pdt)
            self.q_b_proj = fan_in_param(
                rngs, (r, h, cfg.qk_head_dim), ("q_lora", "heads", "head_dim"), r, pdt
            )
        self.kv_a_proj = fan_in_param(
            rngs, (d, cfg.kv_lora_rank + cfg.qk_rope_head_dim), ("embed", "kv_lora"), d, pdt
        )
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, "kv_lora", pdt)
        self.kv_b_proj = fan_in_param(
            rngs,
            (cfg.kv_lora_rank, h, cfg.qk_nope_head_dim + cfg.v_head_dim),
            ("kv_lora", "heads", "head_dim"),
            cfg.kv_lora_rank,
            pdt,
        )
        self.o_proj = fan_in_param(
            rngs, (h, cfg.v_head_dim, d), ("heads", "head_dim", "embed"), h * cfg.v_head_dim, pdt
        )

    def queries(
        self, x_BTD: jax.Array, cos: jax.Array, sin: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(q_nope [B,T,H,nope], q_rope [B,T,H,rope]) with RoPE applied."""
        dt = x_BTD.dtype
        if self.cfg.q_lora_rank is None:
            q = project(x_BTD, compute_weight(self.q_proj, dt))
        else:
            c = self.q_a_norm(project(x_BTD, compute_weight(self.q_a_proj, dt)))
            q = project(c, compute_weight(self.q_b_proj, dt))
        q_nope, q_rope = jnp.split(q, [self.cfg.qk_nope_head_dim], axis=-1)
        return q_nope, rope.apply_rope(q_rope, cos, sin)

    def latents(
        self, x_BTD: jax.Array, cos: jax.Array, sin: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(normed kv latent [B,T,R], rotary key [B,T,rope]): all a KV cache or CP exchange needs."""
        dt = x_BTD.dtype
        kv = project(x_BTD, compute_weight(self.kv_a_proj, dt))
        c_kv, k_rope = jnp.split(kv, [self.cfg.kv_lora_rank], axis=-1)
        return self.kv_a_norm(c_kv), rope.apply_rope(k_rope, cos, sin)

    def attend(
        self,
        q_nope: jax.Array,
        q_rope: jax.Array,
        c_kv_BSR: jax.Array,
        k_rope_BSK: jax.Array,
        mask_BTS: jax.Array,
    ) -> jax.Array:
        """Attention of T queries over S latent tokens, projected back to the model width."""
        return self._dense(q_nope, q_rope, c_kv_BSR, k_rope_BSK, mask_BTS)[0]

    def _dense(self, q_nope, q_rope, c_kv_BSR, k_rope_BSK, mask_BTS, counted_BT=None):
        """(`attend`'s output, each head's largest visible logit [H] over the queries
        `counted_BT` marks, by default all)."""
        cfg, dt = self.cfg, q_nope.dtype
        q, k, v = self.heads(q_nope, q_rope, c_kv_BSR, k_rope_BSK)
        scores = jnp.einsum("bthk,bshk->bhts", q, k, preferred_element_type=jnp.float32)
        probs = attention_probs(scores, mask_BTS, cfg, dt)
        out = jnp.einsum("bhts,bshk->bthk", probs, v)
        # The maximum reads the scores through a barrier: the softmax's fusion, and so its
        # rounding, stays the same whether or not anything uses the maximum (router replay's
        # trainer then reproduces a sampler's logits to the bit).
        visible = masked_scores(jax.lax.optimization_barrier(scores), mask_BTS, cfg)
        if counted_BT is None:
            counted_BT = jnp.ones(mask_BTS.shape[:2], bool)
        max_logit_H = head_max_logits(visible.max(axis=-1), counted_BT)
        return project(out, compute_weight(self.o_proj, dt), contract=2), max_logit_H

    def heads(
        self, q_nope: jax.Array, q_rope: jax.Array, c_kv_BSR: jax.Array, k_rope_BSK: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(queries [B,T,H,nope+rope], keys [B,S,H,nope+rope], values [B,S,H,v]): keys and
        values expanded from the latents. Scores are one product over [nope | rope] dims, the
        rotary key shared by every head: XLA:CPU runs it 3x faster than the two products summed
        (the rotary one alone was the slowest)."""
        kv = project(c_kv_BSR, compute_weight(self.kv_b_proj, q_nope.dtype))
        k_nope, v = jnp.split(kv, [self.cfg.qk_nope_head_dim], axis=-1)
        B, S, H, _ = k_nope.shape
        k_rope_BSHK = jnp.broadcast_to(k_rope_BSK[:, :, None], (B, S, H, k_rope_BSK.shape[-1]))
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        return q, jnp.concatenate([k_nope, k_rope_BSHK], axis=-1), v

    def __call__(
        self, x_BTD: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(the attention's output [B,T,D], each head's largest visible logit [H], softmax
        scale included: a constant for QK-clip and the logs, no gradient flows through it)."""
        cos, sin = rope.rope_tables(positions_BT, self.cfg)
        q_nope, q_rope = self.queries(x_BTD, cos, sin)
        c_kv, k_rope = self.latents(x_BTD, cos, sin)
        # Under context parallelism every rank needs every key: gather the small latents (not
        # keys and values) over cp; each rank then projects keys and values itself.
        c_kv = constrain(c_kv, ("batch", None, None))
        k_rope = constrain(k_rope, ("batch", None, None))
        key_segments = constrain(segment_ids_BT, ("batch", None))
        key_positions = constrain(positions_BT, ("batch", None))
        if self.cfg.attention_block_size is None:
            mask = attention_mask(segment_ids_BT, positions_BT, key_segments, key_positions)
            return self._dense(q_nope, q_rope, c_kv, k_rope, mask, segment_ids_BT > 0)
        cfg, dt = self.cfg, q_nope.dtype
        q, k, v = self.heads(q_nope, q_rope, c_kv, k_rope)
        out, max_logit_H = blockwise_attention_with_max_logits(
            q,
            k,
            v,
            (segment_ids_BT, positions_BT, key_segments, key_positions),
            rope.softmax_scale(cfg),
            cfg.attention_block_size,
        )
        return project(out, compute_weight(self.o_proj, dt), contract=2), max_logit_H


def masked_scores(scores_BHTS: jax.Array, mask_BTS: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Scores scaled (YaRN mscale included), hidden keys at a large negative value."""
    return jnp.where(mask_BTS[:, None], scores_BHTS * rope.softmax_scale(cfg), _MASKED)


def head_max_logits(row_max_BHT: jax.Array, counted_BT: jax.Array) -> jax.Array:
    """Each head's largest logit [H] over the queries `counted_BT` marks (not padding: padding
    queries attend to each other, and their logits reach no loss)."""
    counted = jnp.where(counted_BT[:, None], row_max_BHT, _MASKED)
    return jax.lax.stop_gradient(counted.max(axis=(0, 2)))


def attention_probs(
    scores_BHTS: jax.Array, mask_BTS: jax.Array, cfg: ModelConfig, dtype
) -> jax.Array:
    """Scaled, masked, float32 softmax, cast to the compute dtype."""
    return jax.nn.softmax(masked_scores(scores_BHTS, mask_BTS, cfg), axis=-1).astype(dtype)


def attention_mask(
    q_segments_BT: jax.Array,
    q_positions_BT: jax.Array,
    k_segments_BS: jax.Array,
    k_positions_BS: jax.Array,
) -> jax.Array:
    """Causal within a document: key s is visible to query t iff same segment and pos_s <= pos_t.

    Defined by positions rather than array order, so it stays right when context parallelism
    reorders the sequence, and attention never crosses packed documents.
    """
    same_doc = q_segments_BT[:, :, None] == k_segments_BS[:, None, :]
    causal = k_positions_BS[:, None, :] <= q_positions_BT[:, :, None]
    return same_doc & causal


# Attention in key blocks with an online softmax (FlashAttention's algorithm, written here in
# plain JAX so that it runs, shards and differentiates on every platform): no [T, S] score matrix
# is ever held, only a [T, block] tile per head, and the backward recomputes each tile from the
# output and its log-sum-exp instead of keeping the probabilities. The visibility of a tile is
# computed from segment ids and positions, so no [T, S] mask is held either.
def _key_blocks(k, v, k_segments, k_positions, block: int):
    """Keys, values, segments and positions as [blocks, B, block, ...] (one block of all keys
    when there are fewer than `block`); padded keys sit at the largest position, after every
    query, so no query sees them."""
    block = min(block, k.shape[1])
    pad = -k.shape[1] % block
    if pad:
        widths = ((0, 0), (0, pad))
        k = jnp.pad(k, widths + ((0, 0),) * (k.ndim - 2))
        v = jnp.pad(v, widths + ((0, 0),) * (v.ndim - 2))
        k_segments = jnp.pad(k_segments, widths)
        k_positions = jnp.pad(k_positions, widths, constant_values=jnp.iinfo(jnp.int32).max)

    def split(x):
        x = x.reshape(x.shape[0], -1, block, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    return tuple(map(split, (k, v, k_segments, k_positions)))


def _tile_scores(q, q_visible, k_tile, seg_tile, pos_tile, scale):
    """Scaled, masked float32 scores of every query over one key block [B, H, T, block];
    `q_visible` is (query segments, query positions). The barrier ties the tile's visibility
    to the queries: it is the same in every layer, and a layer scan's partial evaluation would
    otherwise hoist every block's mask out of the layers' loop, [blocks, B, H, T, block] at
    once (16 GiB a device at the 1T shape)."""
    q, seg_tile, pos_tile = jax.lax.optimization_barrier((q, seg_tile, pos_tile))
    scores = jnp.einsum("bthk,bshk->bhts", q, k_tile, preferred_element_type=jnp.float32)
    visible = attention_mask(*q_visible, seg_tile, pos_tile)
    return jnp.where(visible[:, None], scores * scale, _MASKED)


def _blockwise_forward(q, tiles, q_visible, scale):
    """(output [B,T,H,V] in q's dtype, log-sum-exp [B,H,T] and largest score [B,H,T] of each
    query, float32) of queries over `_key_blocks` tiles."""
    B, T, H, _ = q.shape
    v_dtype, v_dim = tiles[1].dtype, tiles[1].shape[-1]

    def step(carry, tile):
        running_max, total, acc = carry
        k_tile, v_tile, seg_tile, pos_tile = tile
        scores = _tile_scores(q, q_visible, k_tile, seg_tile, pos_tile, scale)
        new_max = jnp.maximum(running_max, scores.max(axis=-1))
        rescale = jnp.exp(running_max - new_max)
        probs = jnp.exp(scores - new_max[..., None])
        total = total * rescale + probs.sum(axis=-1)
        update = jnp.einsum(
            "bhts,bshv->bthv", probs.astype(v_dtype), v_tile, preferred_element_type=jnp.float32
        )
        acc = acc * jnp.moveaxis(rescale, 1, 2)[..., None] + update
        return (new_max, total, acc), None

    init = (
        jnp.full((B, H, T), -jnp.inf, jnp.float32),
        jnp.zeros((B, H, T), jnp.float32),
        jnp.zeros((B, T, H, v_dim), jnp.float32),
    )
    (running_max, total, acc), _ = jax.lax.scan(step, init, tiles)
    out = acc / jnp.moveaxis(total, 1, 2)[..., None]
    return out.astype(q.dtype), running_max + jnp.log(total), running_max


def blockwise_attention(q_BTHK, k_BSHK, v_BSHV, visibility, scale: float, block: int):
    """Softmax attention of queries over keys, `block` keys at a time; `visibility` is (query
    segments [B,T], query positions [B,T], key segments [B,S], key positions [B,S]) as
    `attention_mask` reads them. Equals `MLA.attend`'s dense product within rounding."""
    return blockwise_attention_with_max_logits(q_BTHK, k_BSHK, v_BSHV, visibility, scale, block)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def blockwise_attention_with_max_logits(q_BTHK, k_BSHK, v_BSHV, visibility, scale, block):
    """(`blockwise_attention`, each head's largest visible scaled score [H]): the maximum is the
    online softmax's own running maximum, so it costs a reduction over [B, H, T]; it is a
    constant (its cotangent is ignored)."""
    return _blockwise_fwd(q_BTHK, k_BSHK, v_BSHV, visibility, scale, block)[0]


def _blockwise_fwd(q, k, v, visibility, scale, block):
    """(output, largest logit per head), and for the backward the key tiles (built once) and
    the log-sum-exp."""
    tiles = _key_blocks(k, v, *visibility[2:], block)
    out, lse, row_max = _blockwise_forward(q, tiles, visibility[:2], scale)
    max_logit_H = head_max_logits(row_max, visibility[0] > 0)
    return (out, max_logit_H), (q, tiles, visibility, out, lse)


def _blockwise_bwd(scale, block, residuals, cotangents):
    """Each tile's probabilities recomputed from the log-sum-exp; the query gradient summed
    over tiles, the key and value gradients written per tile."""
    d_out, _ = cotangents  # the largest logit is a constant
    q, tiles, visibility, out, lse = residuals
    f32 = jnp.float32
    # Each query's sum over keys of p * dP: the softmax backward's subtrahend.
    row_dot = jnp.einsum("bthv,bthv->bht", d_out.astype(f32), out.astype(f32))

    def step(d_q, tile):
        k_tile, v_tile, seg_tile, pos_tile = tile
        scores = _tile_scores(q, visibility[:2], k_tile, seg_tile, pos_tile, scale)
        probs = jnp.exp(scores - lse[..., None])
        d_v = jnp.einsum(
            "bhts,bthv->bshv", probs.astype(v_tile.dtype), d_out, preferred_element_type=f32
        )
        d_probs = jnp.einsum("bthv,bshv->bhts", d_out, v_tile, preferred_element_type=f32)
        d_scores = (probs * (d_probs - row_dot[..., None]) * scale).astype(q.dtype)
        d_q = d_q + jnp.einsum("bhts,bshk->bthk", d_scores, k_tile, preferred_element_type=f32)
        d_k = jnp.einsum("bhts,bthk->bshk", d_scores, q, preferred_element_type=f32)
        return d_q, (d_k, d_v)

    d_q, (d_k, d_v) = jax.lax.scan(step, jnp.zeros(q.shape, f32), tiles)
    keys = visibility[2].shape[1]

    def unsplit(x, dtype):  # [blocks, B, block, ...] -> [B, S, ...]
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :keys].astype(dtype)

    k_tiles, v_tiles = tiles[:2]
    return d_q.astype(q.dtype), unsplit(d_k, k_tiles.dtype), unsplit(d_v, v_tiles.dtype), None


blockwise_attention_with_max_logits.defvjp(_blockwise_fwd, _blockwise_bwd)


def mla_max_logits(
    attn: MLA, x_BTD: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array
) -> jax.Array:
    """Largest visible pre-softmax logit of each head [H] over a batch, written out as two
    separate products (no-position and rotary parts): the reference the attention's own
    maxima are tested against, and an offline check of a model's logits."""
    cos, sin = rope.rope_tables(positions_BT, attn.cfg)
    q_nope, q_rope = attn.queries(x_BTD, cos, sin)
    c_kv, k_rope = attn.latents(x_BTD, cos, sin)
    kv = jnp.einsum("bsr,rhk->bshk", c_kv, attn.kv_b_proj[...].astype(c_kv.dtype))
    k_nope = kv[..., : attn.cfg.qk_nope_head_dim]
    scores = jnp.einsum("bthk,bshk->bhts", q_nope, k_nope, preferred_element_type=jnp.float32)
    scores += jnp.einsum("bthk,bsk->bhts", q_rope, k_rope, preferred_element_type=jnp.float32)
    scores = scores * rope.softmax_scale(attn.cfg)
    mask = attention_mask(segment_ids_BT, positions_BT, segment_ids_BT, positions_BT)
    mask = mask & (segment_ids_BT > 0)[:, :, None]
    return jnp.max(jnp.where(mask[:, None], scores, -jnp.inf), axis=(0, 2, 3))
