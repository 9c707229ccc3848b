"""The DeepSeek-V3 / Kimi-K2 transformer: embeddings, scanned dense and MoE stacks, MTP heads.

Layers of one kind are stacked along a leading axis and run with `jax.lax.scan`, so compile time
does not grow with depth. The model is an NNX module; jitted code splits it (`nnx.split`) and merges
it back inside, so everything here is a pure function of the parameter state.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.config import ModelConfig
from composer_jax.model.attention import MLA
from composer_jax.model.layers import DenseMLP, RMSNorm, compute_weight, dtype_of, param
from composer_jax.model.moe import MoE, RoutingStats, drops_tokens
from composer_jax.model.projection import project
from composer_jax.parallel.context_parallel import inverse_order, load_balanced_order
from composer_jax.parallel.mesh import constrain, current_layout

ACTIVATION_AXES = ("batch", "seq", None)


class Block(nnx.Module):
    """Pre-norm residual block: MLA attention then a dense SwiGLU or an MoE feed-forward."""

    def __init__(self, cfg: ModelConfig, use_moe: bool, rngs: nnx.Rngs):
        pdt = cfg.param_dtype
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", pdt)
        self.attn = MLA(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", pdt)
        if use_moe:
            self.mlp = MoE(cfg, rngs)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, pdt, rngs)

    def __call__(self, x, positions, segment_ids, forced_indices=None):
        """(x, expert indices, routing stats, the attention's largest logit per head)."""
        attended, max_logit_H = self.attn(self.attn_norm(x), positions, segment_ids)
        return *self.feed_forward(x + attended, segment_ids > 0, forced_indices), max_logit_H

    def feed_forward(self, x, valid, forced_indices=None):
        """The block's second half (norm, MLP or MoE, residual): (x, expert indices, stats)."""
        h = self.mlp_norm(x)
        if isinstance(self.mlp, MoE):
            out, routing, stats = self.mlp(h, valid, forced_indices)
            return x + out, routing.indices_BTK, stats
        return x + self.mlp(h), None, None


class MTPLayer(nnx.Module):
    """One multi-token-prediction depth: mixes the previous depth's hidden state with the embedding
    of the token `depth` steps ahead, then runs one dense block. Shares embeddings and output head
    with the main model."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, pdt = cfg.hidden_size, cfg.param_dtype
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps, "embed", pdt)
        self.embed_norm = RMSNorm(d, cfg.rms_norm_eps, "embed", pdt)
        self.proj = param(rngs, (2 * d, d), ("mlp", "embed"), (2 * d) ** -0.5, pdt)
        self.block = Block(cfg, use_moe=False, rngs=rngs)
        self.out_norm = RMSNorm(d, cfg.rms_norm_eps, "embed", pdt)

    def mix(self, h, next_embed):
        """The depth's input: both normed, concatenated and projected back to the model width."""
        mixed = jnp.concatenate([self.hidden_norm(h), self.embed_norm(next_embed)], axis=-1)
        return project(mixed, compute_weight(self.proj, h.dtype))

    def __call__(self, h, next_embed, positions, segment_ids):
        """(the depth's hidden state, its attention's largest logit per head)."""
        x, _, _, max_logit_H = self.block(self.mix(h, next_embed), positions, segment_ids)
        return x, max_logit_H


class ForwardOutput(NamedTuple):
    hidden_BTD: jax.Array  # final hidden state, before the output norm
    mtp_hidden_DBTD: jax.Array | None  # per MTP depth d: states predicting token t+1+d (normed)
    router_indices_LBTK: jax.Array  # experts used per MoE layer (for router replay)
    expert_load_LE: jax.Array  # valid tokens routed to each expert, per MoE layer
    replay_replaced_L: jax.Array  # replayed expert slots the plausibility filter replaced
    expert_dropped_L: jax.Array  # valid expert slots an expert-parallel capacity bound dropped
    balance_loss_L: jax.Array  # the sequence-wise balance loss per MoE layer, summed over rows
    # Each attention's largest logit per head, keyed by its parameters' path ("moe_layers/attn":
    # [layers, H]; "mtp/0/block/attn": [H]): what QK-clip reads (`composer_jax.optim.qk_clip`).
    attention_max_logits: dict[str, jax.Array]


# The loss metrics' entry holding `ForwardOutput.attention_max_logits`; the update step takes it
# out (QK-clip reads it) and logs the largest as "attention_max_logit".
ATTENTION_MAX_LOGITS = "attention_max_logits"


def drop_metrics(
    out: ForwardOutput, segment_ids_BT: jax.Array, k: int, valid_tokens: jax.Array | None = None
) -> dict[str, jax.Array]:
    """{"expert_drop_rate": dropped / routed valid slots over the MoE layers} where the traced
    layout bounds the expert exchange; nothing where it cannot drop. `valid_tokens`: those of
    the whole batch `segment_ids_BT` is a micro-batch of, so the micro-batches' rates add up to
    the batch's."""
    layers = out.expert_dropped_L.shape[0]
    if not (layers and drops_tokens()):
        return {}
    if valid_tokens is None:
        valid_tokens = jnp.sum(segment_ids_BT > 0)
    routed = valid_tokens * k * layers
    return {"expert_drop_rate": out.expert_dropped_L.sum() / jnp.maximum(routed, 1)}


def _stack(make: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs) -> nnx.Module:
    """`count` independently initialised copies of a module, stacked along a leading axis."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(r):
        return make(r)

    return create(rngs)


def _run_layers(stack: nnx.Module, x, positions, segment_ids, forced, cfg: ModelConfig):
    """Runs a stacked layer module over its leading axis; returns (x, (indices, routing stats,
    largest attention logits [layers, H])).

    `cfg.scan_layers` compiles one layer body (compile time flat in depth); otherwise the layers
    are unrolled, which is only useful as a baseline and for debugging.
    """
    graphdef, state = nnx.split(stack)

    def body(carry, xs):
        layer_state, forced_indices = xs
        layer = nnx.merge(graphdef, layer_state)
        y, indices, stats, max_logit_H = layer(carry, positions, segment_ids, forced_indices)
        return constrain(y, ACTIVATION_AXES), (indices, stats, max_logit_H)

    if cfg.remat:
        body = jax.checkpoint(body, prevent_cse=False)
    if cfg.scan_layers:
        return jax.lax.scan(body, x, (state, forced))
    outputs = []
    for i in range(jax.tree.leaves(state)[0].shape[0]):
        x, out = body(x, jax.tree.map(lambda a: a[i], (state, forced)))
        outputs.append(out)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *outputs)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, pdt = cfg.hidden_size, cfg.param_dtype
        self.embed = param(rngs, (cfg.vocab_size, d), ("vocab", "embed"), 1.0, pdt)
        self.dense_layers = (
            _stack(lambda r: Block(cfg, False, r), cfg.first_k_dense, rngs)
            if cfg.first_k_dense
            else None
        )
        self.moe_layers = (
            _stack(lambda r: Block(cfg, True, r), cfg.num_moe_layers, rngs)
            if cfg.num_moe_layers
            else None
        )
        self.final_norm = RMSNorm(d, cfg.rms_norm_eps, "embed", pdt)
        self.lm_head = param(rngs, (d, cfg.vocab_size), ("embed", "vocab"), d**-0.5, pdt)
        self.mtp = nnx.List([MTPLayer(cfg, rngs) for _ in range(cfg.num_mtp_layers)])

    def embed_tokens(self, tokens_BT: jax.Array) -> jax.Array:
        """The tokens' rows in the compute dtype. On one device only those rows are cast (XLA
        casts a table before a lookup whole: every decode step); under a layout the table is
        cast where it is stored, so no device holds it gathered in float32."""
        dt = dtype_of(self.cfg.dtype)
        if current_layout() is None:
            return jnp.take(self.embed[...], tokens_BT, axis=0).astype(dt)
        return jnp.take(compute_weight(self.embed, dt), tokens_BT, axis=0)

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array | None = None,
        segment_ids_BT: jax.Array | None = None,
        forced_indices_LBTK: jax.Array | None = None,
        with_mtp: bool = True,
        ahead_tokens_DBT: jax.Array | None = None,
    ) -> ForwardOutput:
        """Main path and MTP states. `ahead_tokens_DBT[d-1]` is the token d+1 places after each
        position (defaults to rolling `tokens_BT`; pass it when the sequence is reordered)."""
        cfg = self.cfg
        B, T = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if segment_ids_BT is None:
            segment_ids_BT = jnp.ones((B, T), jnp.int32)
        x = constrain(self.embed_tokens(tokens_BT), ACTIVATION_AXES)
        max_logits = {}
        if self.dense_layers is not None:
            x, (_, _, max_logits["dense_layers/attn"]) = _run_layers(
                self.dense_layers, x, positions_BT, segment_ids_BT, None, cfg
            )
        if self.moe_layers is not None:
            x, (indices, stats, max_logits["moe_layers/attn"]) = _run_layers(
                self.moe_layers, x, positions_BT, segment_ids_BT, forced_indices_LBTK, cfg
            )
        else:
            indices = jnp.zeros((0, B, T, cfg.num_experts_per_tok), jnp.int32)
            stats = RoutingStats(jnp.zeros((0, cfg.num_experts)), *[jnp.zeros((0,))] * 3)

        mtp_hidden = None
        if with_mtp and len(self.mtp):
            states, h = [], x
            for depth, layer in enumerate(self.mtp, start=1):
                if ahead_tokens_DBT is None:
                    ahead = jnp.roll(tokens_BT, -depth, axis=1)  # wrapped tail: masked by the loss
                else:
                    ahead = ahead_tokens_DBT[depth - 1]
                h, max_logits[f"mtp/{depth - 1}/block/attn"] = layer(
                    h, self.embed_tokens(ahead), positions_BT, segment_ids_BT
                )
                states.append(layer.out_norm(h))
            mtp_hidden = jnp.stack(states)
        return ForwardOutput(
            x,
            mtp_hidden,
            indices,
            stats.load_E,
            stats.replay_replaced,
            stats.dropped,
            stats.balance,
            max_logits,
        )

    def head(self, normed_hidden: jax.Array) -> jax.Array:
        """Output projection to float32 logits."""
        weights = compute_weight(self.lm_head, normed_hidden.dtype)
        return project(normed_hidden, weights, preferred=jnp.float32)

    def logits(self, hidden_BTD: jax.Array) -> jax.Array:
        return self.head(self.final_norm(hidden_BTD))


def forward(
    m: Transformer,
    tokens_BT: jax.Array,
    positions_BT: jax.Array,
    segment_ids_BT: jax.Array,
    forced_indices_LBTK: jax.Array | None = None,
    with_mtp: bool = True,
) -> ForwardOutput:
    """`m(...)` with context parallelism's load-balanced token order when a layout asks for it.

    Inputs and outputs are in the caller's order; in between, the sequence is reordered so that
    each cp rank holds chunks i and 2*cp-1-i (equal causal work). Attention masks depend on
    (segment id, position) only, and MTP's look-ahead tokens are taken before reordering, so the
    result equals the unpermuted forward.
    """
    layout = current_layout()
    cp = 1 if layout is None else layout.cp_size
    if cp == 1:
        return m(tokens_BT, positions_BT, segment_ids_BT, forced_indices_LBTK, with_mtp)
    order = load_balanced_order(tokens_BT.shape[1], cp)
    inverse = inverse_order(order)
    ahead = None
    if with_mtp and len(m.mtp):
        depths = range(1, len(m.mtp) + 1)
        ahead = jnp.stack([jnp.roll(tokens_BT, -d, axis=1) for d in depths])[:, :, order]
    forced = None if forced_indices_LBTK is None else forced_indices_LBTK[:, :, order]
    out = m(
        tokens_BT[:, order],
        positions_BT[:, order],
        segment_ids_BT[:, order],
        forced,
        with_mtp,
        ahead_tokens_DBT=ahead,
    )
    mtp = None if out.mtp_hidden_DBTD is None else out.mtp_hidden_DBTD[:, :, inverse]
    return out._replace(
        hidden_BTD=out.hidden_BTD[:, inverse],
        mtp_hidden_DBTD=mtp,
        router_indices_LBTK=out.router_indices_LBTK[:, :, inverse],
    )


def param_rngs(seed: int) -> nnx.Rngs:
    """Initialisation randomness: RBG keys, whose initialiser compiles ~3x faster than threefry."""
    return nnx.Rngs(params=jax.random.key(seed, impl="rbg"))


def init_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A freshly initialised model, built under jit (eager construction dispatches op by op)."""
    graphdef, state = jax.jit(lambda: nnx.split(Transformer(cfg, param_rngs(seed))))()
    return nnx.merge(graphdef, state)


def compute_logits(
    m: Transformer,
    tokens_BT: jax.Array,
    positions_BT: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
) -> jax.Array:
    """Float32 logits of the main head [B, T, V], jitted; MTP heads are skipped. A 1-D token
    array (one sequence, with 1-D positions / segment ids if given) gives [T, V]."""
    tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
    if tokens_BT.ndim == 1:
        add_batch = lambda x: None if x is None else jnp.asarray(x)[None]  # noqa: E731
        return compute_logits(
            m, tokens_BT[None], add_batch(positions_BT), add_batch(segment_ids_BT)
        )[0]
    graphdef, state = nnx.split(m)
    return _logits_jit(graphdef, state, tokens_BT, positions_BT, segment_ids_BT)


@jax.jit(static_argnums=0)
def _logits_jit(graphdef, state, tokens_BT, positions_BT, segment_ids_BT):
    m = nnx.merge(graphdef, state)
    out = m(tokens_BT, positions_BT, segment_ids_BT, with_mtp=False)
    return m.logits(out.hidden_BTD)
