"""Expert parallelism: tokens travel to the devices that hold their experts and back.

Inside `jax.shard_map`, each device routes its own tokens, sorts every (token, expert) slot by the
group member that holds the expert, exchanges them, runs its local experts with the grouped GEMM,
and sends the results back the same way. Two exchanges, both dropless whatever the routing
unless a capacity factor bounds them (below):
- "ragged" (`lax.ragged_all_to_all`, GPU): only real rows travel; the receive buffer is sized for
  the worst case. "ragged_emulated" moves the same rows with all-gathers so its bookkeeping runs
  (slowly) on CPU tests.
- "padded" (`lax.all_to_all`, every backend, XLA:CPU included): a [group, slots] buffer per
  device, (group size)x the bytes on the wire.
A capacity factor c (`Layout.ep_capacity`) bounds what one device sends one member to
ceil(c x slots / group) rows, GShard's expert capacity taken per device pair: buffers, wire bytes
and the experts' rows shrink by group / c, and rows past the bound are dropped (padding tokens
first, then the batch's later tokens) and reported, so their experts contribute nothing.
Tokens can travel in MXFP8 (results always return in the compute dtype, as in DeepSeek-V3).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from composer_jax.parallel.mesh import BATCH_AXES, Layout
from composer_jax.quant import formats

# (rows [M, D], local expert of each row [M] (num_local_experts = padding), gate, up, down) -> [M, D]
LocalExperts = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _exchange(send: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """[G, C, ...] -> [G, C, ...]: block g goes to group member g; block g comes from member g.

    The exchange is its own inverse, so it is also its own transpose for autodiff.
    """
    return jax.lax.all_to_all(send, axes, split_axis=0, concat_axis=0, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _exchange_mxfp8(send: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """The token exchange with the payload in MXFP8 (E4M3 + one scale byte per 32 values), about
    half the bytes of bf16. The gradient travels back unquantized (straight-through)."""
    q = formats.quantize_mxfp8(send, axis=-1)
    values = _exchange(jax.lax.bitcast_convert_type(q.values, jnp.uint8), axes)
    scales = _exchange(q.scales, axes)
    received = formats.MXFP8Tensor(
        jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn), scales, q.axis
    )
    return formats.dequantize(received).astype(send.dtype)


def _exchange_mxfp8_fwd(send, axes):
    return _exchange_mxfp8(send, axes), None


def _exchange_mxfp8_bwd(axes, _, cotangent):
    return (_exchange(cotangent, axes),)


_exchange_mxfp8.defvjp(_exchange_mxfp8_fwd, _exchange_mxfp8_bwd)


class _Plan(NamedTuple):
    """One ragged exchange, seen from one group member (each field [G] int32)."""

    input_offsets: jax.Array  # where my rows for member j start in my buffer
    send_sizes: jax.Array  # how many rows I send to member j
    output_offsets: jax.Array  # where they land in member j's buffer
    recv_sizes: jax.Array  # how many rows member j sends me


def _ragged_all_to_all(x, plan: _Plan, out_rows: int, axes, emulate: bool, fill=0):
    """`lax.ragged_all_to_all`, or the same data movement built from all-gathers (`emulate`):
    slow, but it runs on XLA:CPU, so the bookkeeping around the real thing is tested there."""
    out = jnp.full((out_rows,) + x.shape[1:], fill, x.dtype)
    if not emulate:
        return jax.lax.ragged_all_to_all(
            x,
            out,
            plan.input_offsets,
            plan.send_sizes,
            plan.output_offsets,
            plan.recv_sizes,
            axis_name=axes,
        )
    me = jax.lax.axis_index(axes)
    rows = x.shape[0]
    senders_x = jax.lax.all_gather(x, axes)  # [G, rows, ...]
    starts = jax.lax.all_gather(plan.input_offsets, axes)[:, me]
    sizes = jax.lax.all_gather(plan.send_sizes, axes)[:, me]
    targets = jax.lax.all_gather(plan.output_offsets, axes)[:, me]
    r = jnp.arange(rows)
    source = jnp.clip(starts[:, None] + r, 0, rows - 1)
    destination = jnp.where(r < sizes[:, None], targets[:, None] + r, out_rows)
    moved = senders_x[jnp.arange(senders_x.shape[0])[:, None], source]
    return out.at[destination.reshape(-1)].set(moved.reshape((-1,) + x.shape[1:]), mode="drop")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _ragged_move(x, forward, reverse, in_rows, out_rows, axes, emulate, quantize):
    """Rows to their destinations by `forward`; the gradient returns by `reverse`. With
    `quantize`, the payload travels as MXFP8 (gradient straight-through, unquantized)."""
    move = functools.partial(
        _ragged_all_to_all, plan=forward, out_rows=out_rows, axes=axes, emulate=emulate
    )
    if not quantize:
        return move(x)
    q = formats.quantize_mxfp8(x, axis=-1)
    values = move(jax.lax.bitcast_convert_type(q.values, jnp.uint8))
    received = formats.MXFP8Tensor(
        jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn), move(q.scales), q.axis
    )
    return formats.dequantize(received).astype(x.dtype)


def _ragged_move_fwd(x, forward, reverse, in_rows, out_rows, axes, emulate, quantize):
    out = _ragged_move(x, forward, reverse, in_rows, out_rows, axes, emulate, quantize)
    return out, (forward, reverse)


def _ragged_move_bwd(in_rows, out_rows, axes, emulate, quantize, plans, cotangent):
    _, reverse = plans
    grad = _ragged_all_to_all(cotangent, reverse, in_rows, axes, emulate)
    return grad, None, None


_ragged_move.defvjp(_ragged_move_fwd, _ragged_move_bwd)


def pair_capacity(slots: int, group: int, factor: float | None) -> int:
    """Rows one device may send one member of its group: all its slots (dropless) without a
    factor, else ceil(factor x slots / group), the factor times an even share."""
    if factor is None:
        return slots
    return min(slots, math.ceil(factor * slots / group))


def _padded_dispatch(rows, local_expert, destination, rank, counts, layout, experts_here, cap):
    """Every member gets a [G, cap] buffer, a slot per row it could be sent: static, universal,
    and (without a capacity factor) wasteful. Rows ranked past `cap` are not sent."""
    axes, group = layout.ep_axes, layout.ep_size
    d = rows.shape[1]
    send_x = jnp.zeros((group, cap, d), rows.dtype).at[destination, rank].set(rows, mode="drop")
    send_e = (
        jnp.full((group, cap), experts_here, jnp.int32)
        .at[destination, rank]
        .set(local_expert, mode="drop")
    )
    exchange = _exchange_mxfp8 if layout.quantize_dispatch else _exchange
    received_x = exchange(send_x, axes).reshape(group * cap, d)
    received_e = _exchange(send_e, axes).reshape(group * cap)

    def send_back(results):
        back = _exchange(results.reshape(group, cap, d), axes)
        return back.at[destination, rank].get(mode="fill", fill_value=0)

    return received_x, received_e, send_back


def _ragged_dispatch(rows, local_expert, destination, rank, counts, layout, experts_here, cap):
    """Only real rows travel (`ragged_all_to_all`), at most `cap` to each member; the receive
    buffer holds group x cap rows."""
    axes, group = layout.ep_axes, layout.ep_size
    emulate = layout.dispatch_mode == "ragged_emulated"
    slots = rows.shape[0]
    starts = jnp.cumsum(counts) - counts
    sent = jnp.minimum(counts, cap)
    me = jax.lax.axis_index(axes)
    sent_by = jax.lax.all_gather(sent, axes)  # [sender, receiver]
    earlier = jnp.arange(group)[:, None] < me
    forward = _Plan(
        input_offsets=starts.astype(jnp.int32),
        send_sizes=sent.astype(jnp.int32),
        output_offsets=jnp.sum(jnp.where(earlier, sent_by, 0), axis=0).astype(jnp.int32),
        recv_sizes=_exchange(sent, axes).astype(jnp.int32),
    )
    reverse = _Plan(
        input_offsets=(jnp.cumsum(forward.recv_sizes) - forward.recv_sizes).astype(jnp.int32),
        send_sizes=forward.recv_sizes,
        output_offsets=_exchange(forward.input_offsets, axes),
        recv_sizes=forward.send_sizes,
    )
    capacity = group * cap
    move = functools.partial(_ragged_move, axes=axes, emulate=emulate)
    received_x = move(rows, forward, reverse, slots, capacity, quantize=layout.quantize_dispatch)
    received_e = _ragged_all_to_all(
        local_expert, forward, capacity, axes, emulate, fill=experts_here
    )

    def send_back(results):
        return move(results, reverse, forward, capacity, slots, quantize=False)

    return received_x, received_e, send_back


def _drop_last_order(destination: jax.Array, valid: jax.Array) -> jax.Array:
    """Slots grouped by destination member, valid ones first in each group (token order
    within), so a capacity bound drops padding before real tokens."""
    return jnp.argsort(2 * destination + (~valid).astype(destination.dtype), stable=True)


def routed_experts(
    x_BTD: jax.Array,
    valid_BT: jax.Array,
    indices_BTK: jax.Array,
    weights_BTK: jax.Array,
    gate_EDF: jax.Array,
    up_EDF: jax.Array,
    down_EFD: jax.Array,
    layout: Layout,
    local_experts: LocalExperts,
) -> tuple[jax.Array, jax.Array]:
    """Weighted sum over each token's experts, with experts split across `layout.ep_axes`.
    Returns (output [B, T, D], dropped [B, T, k]: the slots a capacity bound left out)."""
    group = layout.ep_size
    token_spec = P(BATCH_AXES, "cp")
    expert_spec = P(layout.ep_axes)

    def body(x, valid, indices, weights, gate, up, down):
        b, t, d = x.shape
        k = indices.shape[-1]
        experts_here = gate.shape[0]
        slots = b * t * k
        cap = pair_capacity(slots, group, layout.ep_capacity)
        expert = indices.reshape(slots)
        destination = expert // experts_here
        order = _drop_last_order(destination, jnp.repeat(valid.reshape(b * t) > 0, k))
        sorted_destination = destination[order]
        counts = jnp.bincount(destination, length=group)
        starts = jnp.cumsum(counts) - counts
        rank = jnp.arange(slots) - starts[sorted_destination]

        rows = x.reshape(b * t, d)[order // k]  # grouped by destination member
        dispatch = _padded_dispatch if layout.dispatch_mode == "padded" else _ragged_dispatch
        received_x, received_e, send_back = dispatch(
            rows,
            expert[order] % experts_here,
            sorted_destination,
            rank,
            counts,
            layout,
            experts_here,
            cap,
        )
        results = local_experts(received_x, received_e, gate, up, down)
        out_sorted = send_back(results)
        out_slots = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(b, t, k, d)
        mixed = jnp.einsum("btkd,btk->btd", out_slots.astype(jnp.float32), weights)
        dropped = jnp.zeros((slots,), jnp.bool_).at[order].set(rank >= cap).reshape(b, t, k)
        return mixed.astype(x.dtype), dropped

    return jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(token_spec,) * 4 + (expert_spec,) * 3,
        out_specs=(token_spec, token_spec),
        check_vma=False,
    )(x_BTD, valid_BT, indices_BTK, weights_BTK, gate_EDF, up_EDF, down_EFD)
