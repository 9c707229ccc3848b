"""Mixture of experts: sigmoid router with aux-loss-free bias, routed experts, shared expert.

Routing follows DeepSeek-V3: sigmoid scores; an expert bias that only influences *selection*
(never the mixing weights) and is nudged towards balanced load outside the gradient; group-limited
top-k; normalised top-k weights times a routed scaling factor; optionally (pretraining with
`model.balance_loss_alpha`) DeepSeek-V3's complementary sequence-wise balance loss. Router replay:
the caller may force the selected experts (RL replays the sampler's choices); the chosen indices
are always returned.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import EXPERT_GEMM_IMPLS, ModelConfig
from composer_jax.model import grouped_gemm
from composer_jax.model.layers import DenseMLP, compute_weight, fan_in_param
from composer_jax.model.projection import project
from composer_jax.parallel import expert_parallel
from composer_jax.parallel.mesh import current_layout
from composer_jax.quant import moe_gemm

# A forced expert index for a token the sampler never routed (a sequence's last token, which
# predicts nothing, and padding): such a token takes the trainer's own choice, not counted as
# replaced.
UNROUTED = -1


class ExpertBias(nnx.Variable):
    """Selection-only routing bias; updated by the balance rule, never by gradients."""


class Routing(NamedTuple):
    indices_BTK: jax.Array  # int32 expert ids, in the router's order of preference
    weights_BTK: jax.Array  # float32 mixing weights
    scores_BTE: jax.Array  # float32 sigmoid scores of every expert (for replay checks, logging)


class RoutingStats(NamedTuple):
    load_E: jax.Array  # valid tokens routed to each expert
    replay_replaced: jax.Array  # replayed (token, slot) pairs the plausibility filter replaced
    dropped: jax.Array  # valid (token, slot) pairs an expert-parallel capacity bound left out
    balance: jax.Array  # `sequence_balance_loss` summed over the rows


def _ragged_dot(lhs_MK: jax.Array, rhs_EKN: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(
        lhs_MK, rhs_EKN, group_sizes_E, preferred_element_type=jnp.float32
    ).astype(lhs_MK.dtype)


def expert_gemm(
    lhs_MK: jax.Array,
    rhs_EKN: jax.Array,
    group_sizes_E: jax.Array,
    precision: str = "bf16",
    backend: str = "reference",
    impl: str = "auto",
) -> jax.Array:
    """The one grouped matmul all expert FLOPs go through: rows are sorted by expert.

    Rows [sum(group_sizes[:e]), sum(group_sizes[:e+1])) are multiplied by rhs[e]. `precision`
    "bf16" multiplies in the compute dtype with float32 accumulation, by `impl`: "ragged_dot"
    (`lax.ragged_dot`), "tiled" (`grouped_gemm.grouped_matmul`, expert-aligned row tiles as one
    batched matmul: XLA:CPU expands ragged_dot densely, ~groups x the work), or "auto" (tiled
    where the program is lowered for CPU, ragged_dot elsewhere). The low-precision recipes live
    in `composer_jax.quant`.
    """
    if precision != "bf16":
        return moe_gemm.quantized_expert_gemm(
            lhs_MK, rhs_EKN, group_sizes_E, precision=precision, backend=backend
        )
    if impl == "ragged_dot":
        return _ragged_dot(lhs_MK, rhs_EKN, group_sizes_E)
    if impl == "tiled":
        return grouped_gemm.grouped_matmul(lhs_MK, rhs_EKN, group_sizes_E)
    if impl == "auto":
        return jax.lax.platform_dependent(
            lhs_MK,
            rhs_EKN,
            group_sizes_E,
            cpu=grouped_gemm.grouped_matmul,
            default=_ragged_dot,
        )
    raise ValueError(f"expert gemm impl must be one of {EXPERT_GEMM_IMPLS}, got {impl!r}")


def _select_experts(scores_BTE: jax.Array, bias_E: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Group-limited top-k on the biased scores: [B, T, k] expert ids in order of preference."""
    E = cfg.num_experts
    choice = scores_BTE + bias_E
    if cfg.n_group > 1:
        grouped = choice.reshape(choice.shape[:-1] + (cfg.n_group, E // cfg.n_group))
        group_score = jax.lax.top_k(grouped, min(2, E // cfg.n_group))[0].sum(-1)
        _, top_groups = jax.lax.top_k(group_score, cfg.topk_group)
        keep_group = jax.nn.one_hot(top_groups, cfg.n_group, dtype=jnp.bool_).any(-2)
        keep = jnp.repeat(keep_group, E // cfg.n_group, axis=-1)
        choice = jnp.where(keep, choice, -jnp.inf)
    return jax.lax.top_k(choice, cfg.num_experts_per_tok)[1].astype(jnp.int32)


def filter_replayed_experts(
    scores_BTE: jax.Array, forced_BTK: jax.Array, own_BTK: jax.Array, min_ratio: float
) -> tuple[jax.Array, jax.Array]:
    """Router replay's plausibility filter.

    A replayed expert is kept when the trainer's score for it is at least `min_ratio` times the
    trainer's k-th best score (the weakest of its own choices); each other slot takes the trainer's
    most preferred choice not already kept. Returns (indices, replaced mask [B, T, k]).
    """
    threshold = min_ratio * jnp.take_along_axis(scores_BTE, own_BTK, axis=-1).min(-1, keepdims=True)
    kept = jnp.take_along_axis(scores_BTE, forced_BTK, axis=-1) >= threshold
    # A candidate (own choice) is free unless a kept replayed slot already holds that expert.
    taken = ((own_BTK[..., :, None] == forced_BTK[..., None, :]) & kept[..., None, :]).any(-1)
    free = ~taken
    candidate_rank = jnp.cumsum(free, axis=-1) - 1  # rank among free candidates
    slot_rank = jnp.cumsum(~kept, axis=-1) - 1  # rank among replaced slots
    pick = free[..., None, :] & (candidate_rank[..., None, :] == slot_rank[..., :, None])
    substitute = jnp.sum(jnp.where(pick, own_BTK[..., None, :], 0), axis=-1)
    return jnp.where(kept, forced_BTK, substitute).astype(jnp.int32), ~kept


def route(
    scores_BTE: jax.Array,
    bias_E: jax.Array,
    cfg: ModelConfig,
    forced_indices_BTK: jax.Array | None = None,
) -> tuple[Routing, jax.Array]:
    """Chooses experts (or replays forced ones) and their mixing weights.

    Weights always come from the live unbiased scores of the chosen experts, so the router gets
    gradients under replay too. With `cfg.replay_min_ratio` > 0, implausible replayed experts are
    replaced (see `filter_replayed_experts`); a token forced to `UNROUTED` takes its own choice.
    Returns (routing, replaced mask [B, T, k]).
    """
    indices = _select_experts(scores_BTE, bias_E, cfg)
    replaced = jnp.zeros(indices.shape, jnp.bool_)
    if forced_indices_BTK is not None:
        recorded_BT1 = (forced_indices_BTK >= 0).all(-1, keepdims=True)
        forced = jnp.where(recorded_BT1, forced_indices_BTK.astype(jnp.int32), indices)
        if cfg.replay_min_ratio > 0:
            indices, replaced = filter_replayed_experts(
                scores_BTE, forced, indices, cfg.replay_min_ratio
            )
            replaced = replaced & recorded_BT1
        else:
            indices = forced
    weights = jnp.take_along_axis(scores_BTE, indices, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return Routing(indices, weights * cfg.routed_scaling_factor, scores_BTE), replaced


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

    def _local_experts(self, rows_MD, expert_of_row_M, gate_EDF, up_EDF, down_EFD) -> jax.Array:
        """SwiGLU of each row through its expert; rows whose expert id is out of range (padding
        from an expert-parallel exchange) come back as zeros."""
        cfg = self.cfg
        num_experts = gate_EDF.shape[0]
        order = jnp.argsort(expert_of_row_M, stable=True)
        group_sizes = jnp.bincount(expert_of_row_M, length=num_experts).astype(jnp.int32)
        gemm = functools.partial(
            expert_gemm,
            group_sizes_E=group_sizes,
            precision=cfg.expert_precision,
            backend=cfg.expert_backend,
            impl=cfg.expert_gemm_impl,
        )
        rows = rows_MD[order]
        h = jax.nn.silu(gemm(rows, gate_EDF)) * gemm(rows, up_EDF)
        out_sorted = gemm(h, down_EFD)
        return jnp.zeros_like(out_sorted).at[order].set(out_sorted)

    def __call__(
        self, x_BTD: jax.Array, valid_BT: jax.Array, forced_indices_BTK: jax.Array | None = None
    ) -> tuple[jax.Array, Routing, RoutingStats]:
        """Returns (output, routing, statistics over valid tokens)."""
        cfg, dt = self.cfg, x_BTD.dtype
        router = compute_weight(self.router, jnp.float32)
        logits = project(x_BTD.astype(jnp.float32), router)
        routing, replaced = route(
            jax.nn.sigmoid(logits), self.expert_bias[...], cfg, forced_indices_BTK
        )

        gate, up, down = (compute_weight(w, dt) for w in (self.gate, self.up, self.down))
        layout = current_layout()
        if layout is not None and layout.ep_size > 1:
            out, dropped = expert_parallel.routed_experts(
                x_BTD,
                valid_BT,
                routing.indices_BTK,
                routing.weights_BTK,
                gate,
                up,
                down,
                layout,
                self._local_experts,
            )
        else:
            B, T, D = x_BTD.shape
            k = cfg.num_experts_per_tok
            rows = jnp.repeat(x_BTD.reshape(B * T, D), k, axis=0)  # one row per (token, slot)
            out_slots = self._local_experts(rows, routing.indices_BTK.reshape(-1), gate, up, down)
            routed = jnp.einsum(
                "btkd,btk->btd",
                out_slots.reshape(B, T, k, D).astype(jnp.float32),
                routing.weights_BTK,
            )
            out = routed.astype(dt)
            dropped = jnp.zeros(routing.indices_BTK.shape, jnp.bool_)
        if self.shared is not None:
            out = out + self.shared(x_BTD)
        valid_slots = jnp.broadcast_to(valid_BT[..., None], routing.indices_BTK.shape)
        load = (
            jnp.zeros((cfg.num_experts,), jnp.float32)
            .at[routing.indices_BTK]
            .add(valid_slots.astype(jnp.float32))
        )
        replaced_slots = jnp.sum(replaced & valid_slots).astype(jnp.float32)
        dropped_slots = jnp.sum(dropped & valid_slots).astype(jnp.float32)
        balance = sequence_balance_loss(routing.scores_BTE, routing.indices_BTK, valid_BT).sum()
        return out, routing, RoutingStats(load, replaced_slots, dropped_slots, balance)


def drops_tokens() -> bool:
    """Whether the layout being traced bounds the expert exchange, so slots can be dropped."""
    layout = current_layout()
    return layout is not None and layout.drop_capacity is not None


def sequence_balance_loss(
    scores_BTE: jax.Array, indices_BTK: jax.Array, valid_BT: jax.Array
) -> jax.Array:
    """DeepSeek-V3's complementary sequence-wise balance loss of each row [B]: sum_i f_i P_i over
    the row's valid tokens, f_i = E / (k T) x the tokens that chose expert i (a constant) and
    P_i = the mean of expert i's share of the token's scores (s_i / sum_j s_j). A row whose
    tokens spread evenly over the experts scores 1; it only trains the router (through P)."""
    E, k = scores_BTE.shape[-1], indices_BTK.shape[-1]
    valid = valid_BT.astype(jnp.float32)
    tokens_B = jnp.maximum(valid.sum(-1), 1.0)
    chose_BTE = jax.nn.one_hot(indices_BTK, E, dtype=jnp.bool_).any(-2) & valid_BT[..., None]
    f_BE = E / (k * tokens_B[:, None]) * chose_BTE.sum(1)
    share_BTE = scores_BTE / scores_BTE.sum(-1, keepdims=True)
    p_BE = jnp.einsum("bte,bt->be", share_BTE, valid) / tokens_B[:, None]
    return jnp.sum(jax.lax.stop_gradient(f_BE) * p_BE, axis=-1)


def update_expert_bias(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones."""
    return bias_E + rate * jnp.sign(load_E.mean(-1, keepdims=True) - load_E)
