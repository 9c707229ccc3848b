"""Mixture of experts: sigmoid router with aux-loss-free bias, routed experts, shared expert.

Routing follows DeepSeek-V3: sigmoid scores; an expert bias that only influences *selection*
(never the mixing weights) and is nudged towards balanced load outside the gradient; group-limited
top-k; normalised top-k weights times a routed scaling factor. Router replay: the caller may force
the selected experts (RL replays the sampler's choices); the chosen indices are always returned.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model.layers import DenseMLP, fan_in_param


class ExpertBias(nnx.Variable):
    """Selection-only routing bias; updated by the balance rule, never by gradients."""


class Routing(NamedTuple):
    indices_BTK: jax.Array  # int32 expert ids, in the router's order of preference
    weights_BTK: jax.Array  # float32 mixing weights
    scores_BTE: jax.Array  # float32 sigmoid scores of every expert (for replay checks, logging)


def expert_gemm(lhs_MK: jax.Array, rhs_EKN: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    """The one grouped matmul all expert FLOPs go through: rows are sorted by expert.

    Rows [sum(group_sizes[:e]), sum(group_sizes[:e+1])) are multiplied by rhs[e]. Low-precision
    backends replace this function.
    """
    return jax.lax.ragged_dot(
        lhs_MK, rhs_EKN, group_sizes_E, preferred_element_type=jnp.float32
    ).astype(lhs_MK.dtype)


def route(
    scores_BTE: jax.Array,
    bias_E: jax.Array,
    cfg: ModelConfig,
    forced_indices_BTK: jax.Array | None = None,
) -> Routing:
    """Group-limited top-k on biased scores; weights from the unbiased scores of the chosen experts."""
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    if forced_indices_BTK is None:
        choice = scores_BTE + bias_E
        if cfg.n_group > 1:
            grouped = choice.reshape(choice.shape[:-1] + (cfg.n_group, E // cfg.n_group))
            group_score = jax.lax.top_k(grouped, min(2, E // cfg.n_group))[0].sum(-1)
            _, top_groups = jax.lax.top_k(group_score, cfg.topk_group)
            keep_group = jax.nn.one_hot(top_groups, cfg.n_group, dtype=jnp.bool_).any(-2)
            keep = jnp.repeat(keep_group, E // cfg.n_group, axis=-1)
            choice = jnp.where(keep, choice, -jnp.inf)
        _, indices = jax.lax.top_k(choice, k)
    else:
        indices = forced_indices_BTK
    indices = indices.astype(jnp.int32)
    weights = jnp.take_along_axis(scores_BTE, indices, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return Routing(indices, weights * cfg.routed_scaling_factor, scores_BTE)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, f, e, pdt = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.param_dtype
        self.router = fan_in_param(rngs, (d, e), ("embed", "expert_router"), d, "float32")
        self.expert_bias = ExpertBias(jnp.zeros((e,), jnp.float32), logical_axes=("expert_router",))
        self.gate = fan_in_param(rngs, (e, d, f), ("expert", "expert_embed", "expert_mlp"), d, pdt)
        self.up = fan_in_param(rngs, (e, d, f), ("expert", "expert_embed", "expert_mlp"), d, pdt)
        self.down = fan_in_param(rngs, (e, f, d), ("expert", "expert_mlp", "expert_embed"), f, pdt)
        if cfg.num_shared_experts:
            self.shared = DenseMLP(d, f * cfg.num_shared_experts, pdt, rngs)
        else:
            self.shared = None

    def __call__(
        self, x_BTD: jax.Array, valid_BT: jax.Array, forced_indices_BTK: jax.Array | None = None
    ) -> tuple[jax.Array, Routing, jax.Array]:
        """Returns (output, routing, tokens per expert counted over valid tokens [E])."""
        cfg, dt = self.cfg, x_BTD.dtype
        logits = jnp.einsum("btd,de->bte", x_BTD.astype(jnp.float32), self.router[...])
        routing = route(jax.nn.sigmoid(logits), self.expert_bias[...], cfg, forced_indices_BTK)

        B, T, D = x_BTD.shape
        k = cfg.num_experts_per_tok
        x_ND = x_BTD.reshape(B * T, D)
        expert_of_row = routing.indices_BTK.reshape(-1)  # [N*k]
        order = jnp.argsort(expert_of_row, stable=True)
        group_sizes = jnp.bincount(expert_of_row, length=cfg.num_experts).astype(jnp.int32)
        rows = x_ND[order // k]  # token of each sorted slot
        h = jax.nn.silu(expert_gemm(rows, self.gate[...].astype(dt), group_sizes)) * expert_gemm(
            rows, self.up[...].astype(dt), group_sizes
        )
        out_sorted = expert_gemm(h, self.down[...].astype(dt), group_sizes)
        out_slots = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(B, T, k, D)
        routed = jnp.einsum("btkd,btk->btd", out_slots.astype(jnp.float32), routing.weights_BTK)
        out = routed.astype(dt)
        if self.shared is not None:
            out = out + self.shared(x_BTD)
        load = (
            jnp.zeros((cfg.num_experts,), jnp.float32)
            .at[routing.indices_BTK]
            .add(
                jnp.broadcast_to(valid_BT[..., None], routing.indices_BTK.shape).astype(jnp.float32)
            )
        )
        return out, routing, load


def update_expert_bias(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones."""
    return bias_E + rate * jnp.sign(load_E.mean(-1, keepdims=True) - load_E)
