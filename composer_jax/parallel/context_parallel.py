"""Load-balanced context parallelism: which tokens each cp rank holds.

Causal attention makes late tokens expensive (they see everything before them). Splitting the
sequence into 2*cp chunks and giving rank i chunks i and 2*cp-1-i pairs a cheap chunk with an
expensive one, so every rank does the same work. The order only moves tokens: attention masks are
built from (segment id, position), so reordering changes no result.

Communication (per MLA layer, per sequence of T tokens): each rank all-gathers the compressed
latents, T * (kv_lora_rank + qk_rope_head_dim) values, instead of full keys and values,
T * heads * (qk_nope + qk_rope + v_head_dim) values: for Kimi-K2, 576 vs 64 * 320 = 20480 per
token, 35x less traffic; keys and values are then projected locally from the gathered latents.
"""

from __future__ import annotations

import numpy as np


def load_balanced_order(seq_len: int, cp: int) -> np.ndarray:
    """Permutation p of range(seq_len): position j of the reordered sequence holds token p[j].

    Contiguous shards of the reordered sequence are rank i's chunks i and 2*cp-1-i.
    """
    if cp == 1:
        return np.arange(seq_len)
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp={2 * cp}")
    chunks = np.arange(seq_len).reshape(2 * cp, seq_len // (2 * cp))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


def inverse_order(order: np.ndarray) -> np.ndarray:
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return inverse


def causal_work_per_rank(seq_len: int, cp: int, balanced: bool = True) -> np.ndarray:
    """Unmasked (query, key) pairs of causal attention that each cp rank's queries cover."""
    order = load_balanced_order(seq_len, cp) if balanced else np.arange(seq_len)
    queries = order.reshape(cp, seq_len // cp)
    return (queries + 1).sum(axis=1)
