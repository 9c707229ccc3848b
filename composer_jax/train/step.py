"""The pretraining step: next-token cross-entropy + MTP loss, AdamW update, router balance update.

Everything here is a pure function of (TrainState, batch); `train.loop.TrainSetup.jit_train_step`
adds the jit with explicit shardings (state donated). Batches are dicts of [B, T] int32 arrays:
tokens, segment_ids (0 = padding), positions (restart at 0 per packed document), and optionally
loss_mask (1 on tokens to learn). Targets are derived here: token t+1 is a target of position t
only inside the same document.

Gradients are taken over the master weights (`model.param_dtype`, fp32 by default) while the
forward pass computes in `model.dtype`. The MTP loss is by default self-distillation
(`train.mtp_loss` "distill"): depth d's head at t is pulled towards the main head's stop-gradient
distribution at t + d, which predicts the same token; "ce" trains it on the labels instead.
`apply_gradients` is the one gradient step pretraining and RL share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from composer_jax.config import ModelConfig, TrainConfig
from composer_jax.model.moe import ExpertBias, update_expert_bias
from composer_jax.model.transformer import ATTENTION_MAX_LOGITS, Transformer, drop_metrics, forward
from composer_jax.optim import QKClip
from composer_jax.parallel.mesh import Layout, committed_alike, constrain, use_layout

Batch = dict[str, jax.Array]


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: nnx.State  # fp32 master weights (nnx.Param)
    buffers: nnx.State  # non-trainable state: expert routing biases
    opt_state: Any


def split_model(m: Transformer) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, params, buffers): the static structure and the two kinds of state."""
    return nnx.split(m, nnx.Param, ExpertBias)


def init_train_state(m: Transformer, optimizer: optax.GradientTransformation) -> TrainState:
    _, params, buffers = split_model(m)
    # Committed alike: a state of loaded weights would otherwise compile its step twice.
    return committed_alike(
        TrainState(jnp.zeros((), jnp.int32), params, buffers, optimizer.init(params))
    )


def shift_targets(
    tokens_BT: jax.Array, segment_ids_BT: jax.Array, shift: int
) -> tuple[jax.Array, jax.Array]:
    """Targets tokens[t+shift] and a mask true where that token belongs to position t's document."""
    T = tokens_BT.shape[1]
    targets = jnp.roll(tokens_BT, -shift, axis=1)
    same_doc = jnp.roll(segment_ids_BT, -shift, axis=1) == segment_ids_BT
    in_range = jnp.arange(T) < T - shift
    return targets, same_doc & in_range & (segment_ids_BT > 0)


def batch_targets(batch: Batch, shift: int) -> tuple[jax.Array, jax.Array]:
    """`shift_targets`, further limited to target tokens that the batch's optional `loss_mask`
    marks (SFT trains on completions only)."""
    targets, mask = shift_targets(batch["tokens"], batch["segment_ids"], shift)
    if "loss_mask" in batch:
        mask = mask & (jnp.roll(batch["loss_mask"], -shift, axis=1) > 0)
    return targets, mask


def token_cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    log_z = jax.nn.logsumexp(logits_BTV, axis=-1)
    picked = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return log_z - picked


def _masked_mean(x: jax.Array, mask: jax.Array, count: jax.Array | None = None) -> jax.Array:
    """Mean of `x` where `mask`, over `count` tokens (default: the mask's own)."""
    count = mask.sum() if count is None else count
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(count, 1)


def target_counts(batch: Batch, num_mtp_layers: int) -> jax.Array:
    """[1 + depths] target tokens of the main head and of each MTP depth in `batch`: the
    denominators of its mean losses."""
    return jnp.stack(
        [batch_targets(batch, 1 + depth)[1].sum() for depth in range(1 + num_mtp_layers)]
    )


def pretrain_loss(
    m: Transformer,
    batch: Batch,
    cfg: TrainConfig,
    counts: jax.Array | None = None,
    batch_rows: int | None = None,
    batch_tokens: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Cross-entropy of the main head plus `mtp_weight` x mean MTP loss over depths, plus
    `model.balance_loss_alpha` x the sequence-wise balance loss (summed over MoE layers, mean
    over rows). `counts` (`target_counts` of a whole batch this one is a micro-batch of),
    `batch_rows` (its rows) and `batch_tokens` (its valid tokens) make each mean a share of the
    whole batch's, so the micro-batches' losses and rates add up to it."""
    out = forward(m, batch["tokens"], batch["positions"], batch["segment_ids"])
    logits = m.logits(out.hidden_BTD)
    targets, mask = batch_targets(batch, 1)
    count = None if counts is None else counts[0]
    ce = _masked_mean(token_cross_entropy(logits, targets), mask, count)
    metrics = {
        "ce": ce,
        "tokens": mask.sum().astype(jnp.float32),
        "expert_load": out.expert_load_LE,
        ATTENTION_MAX_LOGITS: out.attention_max_logits,
        **drop_metrics(out, batch["segment_ids"], m.cfg.num_experts_per_tok, batch_tokens),
    }
    loss = ce
    if m.cfg.balance_loss_alpha and out.balance_loss_L.shape[0]:
        rows = batch["tokens"].shape[0] if batch_rows is None else batch_rows
        metrics["balance_loss"] = out.balance_loss_L.sum() / rows
        loss = loss + m.cfg.balance_loss_alpha * metrics["balance_loss"]
    if out.mtp_hidden_DBTD is not None:
        teacher_logp = jax.nn.log_softmax(jax.lax.stop_gradient(logits), axis=-1)
        mtp_losses = []
        for depth_index, h in enumerate(out.mtp_hidden_DBTD):
            depth = depth_index + 1
            student_logits = m.head(h)
            mtp_targets, mtp_mask = batch_targets(batch, 1 + depth)
            if cfg.mtp_loss == "ce":
                per_token = token_cross_entropy(student_logits, mtp_targets)
            else:  # KL(main head at t+depth || MTP head at t): both predict token t+1+depth.
                teacher = jnp.roll(teacher_logp, -depth, axis=1)
                student = jax.nn.log_softmax(student_logits, axis=-1)
                per_token = jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1)
            count = None if counts is None else counts[depth]
            mtp_losses.append(_masked_mean(per_token, mtp_mask, count))
        mtp = jnp.mean(jnp.stack(mtp_losses))
        metrics["mtp"] = mtp
        loss = loss + cfg.mtp_weight * mtp
    metrics["loss"] = loss
    return loss, metrics


def loss_gradients(
    graphdef: nnx.GraphDef,
    layout: Layout | None,
    state: TrainState,
    model_loss: Callable[[Transformer], tuple[jax.Array, dict]],
) -> tuple[dict[str, jax.Array], Any]:
    """(metrics, gradients) of `model_loss` (of the model merged from the state's params and
    buffers) with respect to the params."""

    def loss_fn(params):
        return model_loss(nnx.merge(graphdef, params, state.buffers))

    with use_layout(layout):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return metrics, grads


def update_params(
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    state: TrainState,
    grads: Any,
    metrics: dict[str, jax.Array],
    qk_clip: QKClip | None = None,
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """The optimizer update from `grads`, then `qk_clip` on the attention maxima the loss
    reported: (new params, new optimizer state, `metrics` plus grad_norm, lr, the largest
    attention logit and with QK-clip the number of heads it rescaled)."""
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, grad_norm=optax.tree_utils.tree_norm(grads), lr=schedule(state.step))
    max_logits = metrics.pop(ATTENTION_MAX_LOGITS, None)
    if max_logits:
        metrics["attention_max_logit"] = jnp.max(jnp.stack([x.max() for x in max_logits.values()]))
        if qk_clip is not None:
            params, metrics["qk_clipped_heads"] = qk_clip(params, max_logits)
    return params, opt_state, metrics


def apply_gradients(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    layout: Layout | None,
    state: TrainState,
    model_loss: Callable[[Transformer], tuple[jax.Array, dict]],
    qk_clip: QKClip | None = None,
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """The gradient step every trainer shares: differentiate `model_loss`, apply the optimizer
    (and `qk_clip`). Returns (new params, new optimizer state, `update_params`'s metrics)."""
    metrics, grads = loss_gradients(graphdef, layout, state, model_loss)
    return update_params(optimizer, schedule, state, grads, metrics, qk_clip)


def split_microbatches(batch: Batch, microbatches: int) -> Batch:
    """[B, ...] arrays as [microbatches, B / microbatches, ...]: micro-batch k takes rows k,
    k + microbatches, ..., so a device's contiguous rows hold a share of every micro-batch and
    splitting moves nothing between devices."""

    def split(x):
        x = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
        return constrain(x, (None, "batch", "seq")[: x.ndim])

    return jax.tree.map(split, batch)


def accumulated_gradients(
    graphdef: nnx.GraphDef,
    layout: Layout | None,
    state: TrainState,
    batch: Batch,
    train_cfg: TrainConfig,
    num_mtp_layers: int,
    microbatches: int,
) -> tuple[dict[str, jax.Array], Any]:
    """(metrics, gradients) of the whole batch's pretraining loss, taken one micro-batch at a
    time (in a scan: one micro-batch's activations live at once) and summed; each
    micro-batch's loss is its share of the batch's mean (`target_counts`), so the sums are the
    whole batch's loss, gradients and metrics (the attention maxima: their maximum)."""
    counts = target_counts(batch, num_mtp_layers)
    rows, tokens = batch["tokens"].shape[0], jnp.sum(batch["segment_ids"] > 0)
    with use_layout(layout):
        micro = split_microbatches(batch, microbatches)

    def one(mb):
        return loss_gradients(
            graphdef,
            layout,
            state,
            lambda m: pretrain_loss(m, mb, train_cfg, counts, rows, tokens),
        )

    def body(total, mb):
        new = one(mb)
        summed = jax.tree.map(jnp.add, total, new)
        maxima = (total[0][ATTENTION_MAX_LOGITS], new[0][ATTENTION_MAX_LOGITS])
        summed[0][ATTENTION_MAX_LOGITS] = jax.tree.map(jnp.maximum, *maxima)
        return summed, None

    first = jax.tree.map(lambda x: x[0], micro)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(one, first))
    zeros[0][ATTENTION_MAX_LOGITS] = jax.tree.map(
        lambda x: jnp.full_like(x, -jnp.inf), zeros[0][ATTENTION_MAX_LOGITS]
    )
    total, _ = jax.lax.scan(body, zeros, micro)
    return total


def train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    schedule: optax.Schedule,
    layout: Layout | None,
    state: TrainState,
    batch: Batch,
    microbatches: int = 1,
    qk_clip: QKClip | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step; `layout` (bound before jit) enables EP/CP and activation shardings.
    With `microbatches` > 1 (the phase's) the gradients are accumulated over micro-batches."""
    if microbatches > 1:
        metrics, grads = accumulated_gradients(
            graphdef, layout, state, batch, train_cfg, model_cfg.num_mtp_layers, microbatches
        )
        params, opt_state, metrics = update_params(
            optimizer, schedule, state, grads, metrics, qk_clip
        )
    else:
        params, opt_state, metrics = apply_gradients(
            graphdef,
            optimizer,
            schedule,
            layout,
            state,
            lambda m: pretrain_loss(m, batch, train_cfg),
            qk_clip,
        )
    load = metrics.pop("expert_load")
    buffers = state.buffers
    if load.shape[0]:
        bias = buffers["moe_layers"]["mlp"]["expert_bias"]
        bias[...] = update_expert_bias(bias[...], load, model_cfg.router_bias_update_rate)
        metrics["expert_load_max_over_mean"] = jnp.max(
            load / jnp.maximum(load.mean(-1, keepdims=True), 1e-9)
        )
    return TrainState(state.step + 1, params, buffers, opt_state), metrics


def eval_step(
    graphdef: nnx.GraphDef, layout: Layout | None, state: TrainState, batch: Batch
) -> dict[str, jax.Array]:
    """Summed next-token NLL and token count of the main head (no MTP), for held-out data."""
    m = nnx.merge(graphdef, state.params, state.buffers)
    with use_layout(layout):
        out = forward(m, batch["tokens"], batch["positions"], batch["segment_ids"], with_mtp=False)
    targets, mask = shift_targets(batch["tokens"], batch["segment_ids"], 1)
    nll = token_cross_entropy(m.logits(out.hidden_BTD), targets)
    return {"nll_sum": jnp.sum(jnp.where(mask, nll, 0.0)), "tokens": mask.sum()}
