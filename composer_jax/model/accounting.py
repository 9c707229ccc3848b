"""Parameter and FLOP accounting from shapes alone: works for the 1T-parameter preset on a laptop.

Shapes come from `nnx.eval_shape` of the real model, so the counts cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model.transformer import Transformer


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter, embeddings, output head and MTP heads included
    active: int  # used per token: routed experts count only num_experts_per_tok of them
    embedding: int  # input embedding table
    output_head: int
    routed_experts: int  # all routed-expert weights
    mtp: int  # multi-token-prediction heads (excluded from `active`: not in the main path)


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with ShapeDtypeStruct leaves: nothing is allocated."""
    return nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))


def _size(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def count_params(cfg: ModelConfig) -> ParamCounts:
    m = abstract_model(cfg)
    total = _size(nnx.state(m, nnx.Param))
    routed = 0
    if m.moe_layers is not None:
        mlp = m.moe_layers.mlp
        routed = _size([mlp.gate, mlp.up, mlp.down])
    mtp = _size(nnx.state(m.mtp, nnx.Param))
    active = total - mtp - routed + routed * cfg.num_experts_per_tok // cfg.num_experts
    return ParamCounts(
        total=total,
        active=active,
        embedding=_size(m.embed),
        output_head=_size(m.lm_head),
        routed_experts=routed,
        mtp=mtp,
    )


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs of scores and weighted values for one token at average causal context."""
    avg_context = (seq_len + 1) / 2
    per_layer = 2 * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * avg_context
    return per_layer * cfg.num_layers


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 x active matmul parameters (embedding lookup excluded) + 3 x attention forward FLOPs."""
    counts = count_params(cfg)
    matmul_params = counts.active - counts.embedding
    return 6.0 * matmul_params + 3.0 * attention_flops_per_token(cfg, seq_len)
