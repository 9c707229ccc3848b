"""Dropless expert parallelism: tokens travel to the devices that hold their experts and back.

Inside `jax.shard_map`, each device routes its own tokens, packs every (token, expert) slot into a
buffer per destination device of the expert-parallel group, exchanges the buffers with one
all-to-all, runs its local experts with the grouped GEMM, and sends the results back the same
way. This padded exchange reserves room for every local slot per destination, so no token is ever
dropped whatever the routing, at the price of (group size)x buffer memory; it runs on every
backend, XLA:CPU included. Tokens can travel in MXFP8 (results always return in the compute
dtype, as in DeepSeek-V3).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

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


def routed_experts(
    x_BTD: jax.Array,
    indices_BTK: jax.Array,
    weights_BTK: jax.Array,
    gate_EDF: jax.Array,
    up_EDF: jax.Array,
    down_EFD: jax.Array,
    layout: Layout,
    local_experts: LocalExperts,
) -> jax.Array:
    """Weighted sum over each token's experts, with experts split across `layout.ep_axes`."""
    axes = layout.ep_axes
    group = layout.ep_size
    token_spec = P(BATCH_AXES, "cp")
    expert_spec = P(axes)

    def body(x, indices, weights, gate, up, down):
        b, t, d = x.shape
        k = indices.shape[-1]
        experts_here = gate.shape[0]
        slots = b * t * k
        expert = indices.reshape(slots)
        destination = expert // experts_here
        order = jnp.argsort(destination, stable=True)
        sorted_destination = destination[order]
        counts = jnp.bincount(destination, length=group)
        starts = jnp.cumsum(counts) - counts
        rank = jnp.arange(slots) - starts[sorted_destination]

        rows = x.reshape(b * t, d)[order // k]
        send_x = jnp.zeros((group, slots, d), x.dtype).at[sorted_destination, rank].set(rows)
        send_e = jnp.full((group, slots), experts_here, jnp.int32)
        send_e = send_e.at[sorted_destination, rank].set(expert[order] % experts_here)

        dispatch = _exchange_mxfp8 if layout.quantize_dispatch else _exchange
        received_x = dispatch(send_x, axes).reshape(group * slots, d)
        received_e = _exchange(send_e, axes).reshape(group * slots)
        results = local_experts(received_x, received_e, gate, up, down)
        returned = _exchange(results.reshape(group, slots, d), axes)

        out_sorted = returned[sorted_destination, rank]
        out_slots = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(b, t, k, d)
        mixed = jnp.einsum("btkd,btk->btd", out_slots.astype(jnp.float32), weights)
        return mixed.astype(x.dtype)

    return jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(token_spec, token_spec, token_spec, expert_spec, expert_spec, expert_spec),
        out_specs=token_spec,
        check_vma=False,
    )(x_BTD, indices_BTK, weights_BTK, gate_EDF, up_EDF, down_EFD)
