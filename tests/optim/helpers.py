"""A small parameter tree covering every kind of Muon / AdamW parameter, with logical axes."""

import jax
import numpy as np

# name: (shape, logical axes). On 8 devices some matrices shard on rows, one on columns, some on a
# batch axis (heads, experts), expert matrices also over replica, and most batches do not divide
# the number of devices (padding).
SPECS = {
    "embed": ((24, 16), ("vocab", "embed")),
    "norm": ((3, 16), ("layers", "embed")),
    "q_a_proj": ((3, 16, 8), ("layers", "embed", "q_lora")),
    "q_b_proj": ((3, 8, 2, 6), ("layers", "q_lora", "heads", "head_dim")),
    "o_proj": ((3, 8, 4, 16), ("layers", "heads", "head_dim", "embed")),
    "kv_a_proj": ((16, 12), ("embed", "kv_lora")),
    "router": ((3, 16, 4), ("layers", "embed", "expert_router")),
    "experts_up": ((3, 8, 16, 8), ("layers", "expert", "expert_embed", "expert_mlp")),
    "experts_down": ((3, 8, 8, 16), ("layers", "expert", "expert_mlp", "expert_embed")),
    "mlp_down": ((24, 16), ("mlp", "embed")),
    "shared_down": ((6, 16), ("mlp", "embed")),  # rows do not divide: columns get sharded
    "lm_head": ((16, 24), ("embed", "vocab")),
}


def make_tree(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(shape).astype(np.float32) for k, (shape, _) in SPECS.items()}


def logical_axes() -> dict:
    return {k: axes for k, (_, axes) in SPECS.items()}


def put(tree: dict, shardings: dict | None) -> dict:
    if shardings is None:
        return jax.tree.map(jax.numpy.asarray, tree)
    return jax.device_put(tree, shardings)
