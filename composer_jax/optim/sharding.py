"""Shardings for optimizer states whose parameter-shaped parts are masked or partitioned."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding


def _key(path) -> tuple[str, ...]:
    return tuple(str(entry) for entry in path)


def shard_like_params(opt_state, params, param_shardings, default: NamedSharding):
    """A sharding for every leaf of `opt_state`: the parameter's where the leaf is a copy of one.

    A leaf is a copy of a parameter when its key path ends with that parameter's key path and the
    shapes agree. This covers plain states (Adam moments) and the masked subtrees that
    `optax.partition` / `optax.masked` build (Muon momentum for matrices only), which a
    whole-structure comparison misses. Everything else (counters) gets `default`.
    """
    per_leaf = jax.tree.map(
        lambda sh, sub: jax.tree.map(lambda _: sh, sub),
        param_shardings,
        params,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    index = {}
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_sh = jax.tree.leaves(per_leaf, is_leaf=lambda x: isinstance(x, NamedSharding))
    for (path, p), sh in zip(flat_params, flat_sh):
        index[_key(path)] = (tuple(p.shape), sh)

    def pick(path, leaf):
        key = _key(path)
        for start in range(len(key)):
            hit = index.get(key[start:])
            if hit is not None and hit[0] == tuple(leaf.shape):
                return hit[1]
        return default

    return jax.tree_util.tree_map_with_path(pick, opt_state)
