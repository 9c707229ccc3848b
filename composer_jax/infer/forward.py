"""Cached forward passes built from the model's own layers, so inference matches training.

A chunk is T new tokens for each of B cache slots (prefill: a bucketed prompt piece; decode: one
token; speculative verification: the draft). Each block is the training `Block` with its attention
swapped for `cached_attention`; norms, MLPs, the MoE (with its routing), embeddings and the head
are the model's modules, called as they are in training.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from composer_jax.infer import sampling
from composer_jax.infer.cache import LatentCache, cached_attention, chunk_masks
from composer_jax.infer.sampling import Sampled
from composer_jax.model.transformer import Block, Transformer
from composer_jax.parallel.mesh import pinned


class ChunkOutput(NamedTuple):
    hidden_BTD: jax.Array  # final hidden state (before the output norm)
    experts_LBTK: jax.Array  # routed experts per MoE layer
    cache: LatentCache


class _Rows(NamedTuple):
    """Where a chunk reads and writes the cache."""

    slot_ids_B: jax.Array | None  # the slot of each row (>= slots: padding); None: row b is slot b
    write_BT: jax.Array  # the position each token writes; past the cache for invalid tokens
    span: int  # cache positions [0, span) are read
    masks: tuple[jax.Array, jax.Array]  # `chunk_masks`


def _rows(cache: LatentCache, positions_BT, valid_BT, slot_ids_B, span: int | None) -> _Rows:
    max_len = cache.c_kv_LNSR.shape[2]
    span = max_len if span is None else span
    write_BT = jnp.where(valid_BT, positions_BT, max_len)
    return _Rows(slot_ids_B, write_BT, span, chunk_masks(positions_BT, valid_BT, span))


def _read(a_LNSF: jax.Array, layer, rows: _Rows) -> jax.Array:
    """Layer `layer`'s cached rows of the chunk, positions [0, span); padding slots read zeros."""
    part_NWF = jax.lax.dynamic_index_in_dim(a_LNSF, layer, axis=0, keepdims=False)[:, : rows.span]
    if rows.slot_ids_B is None:
        return part_NWF
    return jnp.take(part_NWF, rows.slot_ids_B, axis=0, mode="fill", fill_value=0)


def _write(a_LNSF: jax.Array, layer, rows: _Rows, new_BTF: jax.Array) -> jax.Array:
    """The chunk's entries written in place (invalid tokens and padding slots write nowhere)."""
    slots_B = rows.slot_ids_B
    if slots_B is None:
        slots_B = jnp.arange(new_BTF.shape[0])
    return a_LNSF.at[layer, slots_B[:, None], rows.write_BT].set(new_BTF, mode="drop")


def _block(layer: Block, x_BTD, positions_BT, valid_BT, cache: LatentCache, index, rows, absorbed):
    """`Block.__call__` with cached attention over cache layer `index`; returns (x, expert
    indices or None, cache)."""
    cached = (_read(cache.c_kv_LNSR, index, rows), _read(cache.k_rope_LNSK, index, rows))
    attn_out, c_new, k_new = cached_attention(
        layer.attn, layer.attn_norm(x_BTD), positions_BT, cached, rows.masks, absorbed
    )
    # The write waits for the attention (so for the reads): without this order XLA:CPU copies
    # the whole cache every layer to keep the read apart from the in-place write.
    attn_out, cache = jax.lax.optimization_barrier((attn_out, cache))
    cache = LatentCache(
        _write(cache.c_kv_LNSR, index, rows, c_new), _write(cache.k_rope_LNSK, index, rows, k_new)
    )
    x_BTD, indices, _ = layer.feed_forward(x_BTD + attn_out, valid_BT)
    return x_BTD, indices, cache


def _run_stack(stack: nnx.Module, x_BTD, positions_BT, valid_BT, cache, first: int, rows, absorbed):
    """Scans a stacked layer module (as `_run_layers` does) over cache layers [first, first +
    layers), the cache carried and updated in place. Returns (x, expert indices, cache, layers)."""
    graphdef, state = nnx.split(stack)
    count = jax.tree.leaves(state)[0].shape[0]

    def body(carry, xs):
        x, cache = carry
        layer_state, index = xs
        layer = nnx.merge(graphdef, layer_state)
        x, indices, cache = _block(layer, x, positions_BT, valid_BT, cache, index, rows, absorbed)
        return (x, cache), indices

    layers = first + jnp.arange(count, dtype=jnp.int32)
    (x_BTD, cache), indices = jax.lax.scan(body, (x_BTD, cache), (state, layers))
    return x_BTD, indices, cache, count


def forward_chunk(
    m: Transformer,
    cache: LatentCache,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    valid_BT: jax.Array,
    slot_ids_B: jax.Array | None,
    absorbed: bool,
    span: int | None = None,
) -> ChunkOutput:
    """Main model over a chunk: reads and extends the cache layers [0, num_layers).

    `slot_ids_B` None: row b is slot b (decode over every slot: no gather). `span`: attend over
    cache positions [0, span) only (default: all); every cached position a valid query sees must
    lie below it."""
    cfg = m.cfg
    rows = _rows(cache, positions_BT, valid_BT, slot_ids_B, span)
    x = m.embed_tokens(tokens_BT)
    B, T = tokens_BT.shape
    experts = jnp.zeros((0, B, T, cfg.num_experts_per_tok), jnp.int32)
    first = 0
    for stack in (m.dense_layers, m.moe_layers):
        if stack is None:
            continue
        x, indices, cache, count = _run_stack(
            stack, x, positions_BT, valid_BT, cache, first, rows, absorbed
        )
        if indices is not None:
            experts = indices
        first += count
    return ChunkOutput(x, experts, cache)


@functools.partial(jax.jit, static_argnums=(0, 11, 12, 13), donate_argnums=(2,))
def prefill_chunk(
    graphdef,
    state,
    cache: LatentCache,
    tokens_BT,
    positions_BT,
    valid_BT,
    slot_ids_B,
    last_B,
    temperature_B,
    top_p_B,
    seeds_B,
    absorbed: bool,
    cache_sharding: NamedSharding | None,
    span: int,
) -> tuple[Sampled, jax.Array, LatentCache]:
    """A chunk through the cached model attending over cache positions [0, span) and its own
    tokens, then one token sampled from each row's last valid position. Returns (sample, routed
    experts [L_moe, B, T, k], cache laid out by `cache_sharding`)."""
    m = nnx.merge(graphdef, state)
    out = forward_chunk(m, cache, tokens_BT, positions_BT, valid_BT, slot_ids_B, absorbed, span)
    rows = jnp.arange(tokens_BT.shape[0])
    logits_BV = m.logits(out.hidden_BTD[rows, last_B])
    keys = sampling.token_keys(seeds_B, positions_BT[rows, last_B] + 1)
    sample = sampling.sample(logits_BV, temperature_B, top_p_B, keys)
    return sample, out.experts_LBTK, pinned(out.cache, cache_sharding)


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
    rows = _rows(cache, positions_BT, valid_BT, slot_ids_B, None)
    x = layer.mix(hidden_BTD, m.embed_tokens(next_tokens_BT))
    x, _, cache = _block(
        layer.block, x, positions_BT, valid_BT, cache, m.cfg.num_layers, rows, absorbed
    )
    return layer.out_norm(x), cache
