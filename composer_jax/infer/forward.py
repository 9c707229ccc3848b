"""Cached forward passes built from the model's own layers, so inference matches training.

A chunk is T new tokens for each of B cache slots (prefill: a bucketed prompt piece; decode: one
token; speculative verification: the draft). Each block is the training `Block` with its attention
swapped for `cached_attention`; norms, MLPs, the MoE (with its routing), embeddings and the head
are the model's modules, called as they are in training.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.infer.cache import LatentCache, cached_attention
from composer_jax.model.transformer import Block, Transformer


class ChunkOutput(NamedTuple):
    hidden_BTD: jax.Array  # final hidden state (before the output norm)
    experts_LBTK: jax.Array  # routed experts per MoE layer
    cache: LatentCache


def _block(layer: Block, x_BTD, positions_BT, valid_BT, c_kv_BSR, k_rope_BSK, absorbed: bool):
    """`Block.__call__` with cached attention; returns (x, expert indices or None, cache rows)."""
    attn_out, c_kv_BSR, k_rope_BSK = cached_attention(
        layer.attn, layer.attn_norm(x_BTD), positions_BT, valid_BT, c_kv_BSR, k_rope_BSK, absorbed
    )
    x_BTD, indices, _ = layer.feed_forward(x_BTD + attn_out, valid_BT)
    return x_BTD, indices, c_kv_BSR, k_rope_BSK


def _run_stack(stack: nnx.Module, x_BTD, positions_BT, valid_BT, c_kv_LBSR, k_rope_LBSK, absorbed):
    """Scans a stacked layer module together with its cache layers (as `_run_layers` does)."""
    graphdef, state = nnx.split(stack)

    def body(x, xs):
        layer_state, c_kv, k_rope = xs
        layer = nnx.merge(graphdef, layer_state)
        x, indices, c_kv, k_rope = _block(layer, x, positions_BT, valid_BT, c_kv, k_rope, absorbed)
        return x, (indices, c_kv, k_rope)

    return jax.lax.scan(body, x_BTD, (state, c_kv_LBSR, k_rope_LBSK))


def _gather_rows(cache: LatentCache, layers: slice, slot_ids_B: jax.Array):
    """Cache rows of the chunk's slots; padding slots (id >= slots) read zeros."""
    take = lambda a: jnp.take(a[layers], slot_ids_B, axis=1, mode="fill", fill_value=0)  # noqa: E731
    return take(cache.c_kv_LNSR), take(cache.k_rope_LNSK)


def _scatter_rows(cache: LatentCache, layers: slice, slot_ids_B, c_kv_LBSR, k_rope_LBSK):
    return LatentCache(
        cache.c_kv_LNSR.at[layers, slot_ids_B].set(c_kv_LBSR, mode="drop"),
        cache.k_rope_LNSK.at[layers, slot_ids_B].set(k_rope_LBSK, mode="drop"),
    )


def forward_chunk(
    m: Transformer,
    cache: LatentCache,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    valid_BT: jax.Array,
    slot_ids_B: jax.Array,
    absorbed: bool,
) -> ChunkOutput:
    """Main model over a chunk: reads and extends the cache layers [0, num_layers)."""
    cfg = m.cfg
    main = slice(0, cfg.num_layers)
    c_kv, k_rope = _gather_rows(cache, main, slot_ids_B)
    x = m.embed_tokens(tokens_BT)
    new_c, new_k = [], []
    B, T = tokens_BT.shape
    experts = jnp.zeros((0, B, T, cfg.num_experts_per_tok), jnp.int32)
    start = 0
    for stack in (m.dense_layers, m.moe_layers):
        if stack is None:
            continue
        count = jax.tree.leaves(nnx.state(stack))[0].shape[0]
        part = slice(start, start + count)
        x, (indices, c, k) = _run_stack(
            stack, x, positions_BT, valid_BT, c_kv[part], k_rope[part], absorbed
        )
        new_c.append(c)
        new_k.append(k)
        if indices is not None:
            experts = indices
        start += count
    cache = _scatter_rows(cache, main, slot_ids_B, jnp.concatenate(new_c), jnp.concatenate(new_k))
    return ChunkOutput(x, experts, cache)


def mtp_chunk(
    m: Transformer,
    cache: LatentCache,
    hidden_BTD: jax.Array,
    next_tokens_BT: jax.Array,
    positions_BT: jax.Array,
    valid_BT: jax.Array,
    slot_ids_B: jax.Array,
    absorbed: bool,
) -> tuple[jax.Array, LatentCache]:
    """First MTP depth over a chunk: at position t it mixes the main hidden state h_t with the
    embedding of token t+1 (`MTPLayer.__call__`) and predicts token t+2. Its attention uses cache
    layer `num_layers`. Returns (normed MTP hidden [B,T,D], cache)."""
    layer = m.mtp[0]
    mtp_layer = slice(m.cfg.num_layers, m.cfg.num_layers + 1)
    c_kv, k_rope = _gather_rows(cache, mtp_layer, slot_ids_B)
    x = layer.mix(hidden_BTD, m.embed_tokens(next_tokens_BT))
    x, _, c, k = _block(layer.block, x, positions_BT, valid_BT, c_kv[0], k_rope[0], absorbed)
    cache = _scatter_rows(cache, mtp_layer, slot_ids_B, c[None], k[None])
    return layer.out_norm(x), cache
