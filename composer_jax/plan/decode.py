"""The sampler's decode step planned ahead of time: one `infer.decode.decode_chunk` step over every
cache slot, compiled from ShapeDtypeStructs as a sharded sampler runs it (an `InferenceEngine`
given the mesh, the training layout's parameter shardings and `use_layout` as its trace context),
so the weights shard like the trainer's (expert-parallel, dense state over fsdp x cp, the cp axis
folded into fsdp since a decode step has no sequence to split) and the latent cache's slots over
the batch axes. Nothing is allocated.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from composer_jax import config as config_lib
from composer_jax.infer.cache import init_cache
from composer_jax.infer.decode import MIN_STOP_TABLE, DecodeInputs, decode_chunk
from composer_jax.model import Transformer
from composer_jax.model.layers import logical_axes_of
from composer_jax.parallel.mesh import AXES, Layout, make_layout, use_layout, with_shardings
from composer_jax.parallel.report import bytes_per_device
from composer_jax.plan import costs
from composer_jax.plan.devices import DeviceSpec


@dataclasses.dataclass(kw_only=True)
class DecodePlan(costs.CompiledCosts):
    """What one decode step over `slots` cache rows of `max_len` tokens needs per device."""

    slots: int
    max_len: int
    params_bytes: int
    cache_bytes: int


class PlanError(ValueError):
    """A decode plan the command line cannot make; the message names the flag."""


def serving_layout(layout: Layout, num_experts: int) -> Layout:
    """`layout`'s devices without context parallelism (a decode step has one position per row,
    nothing splits along the sequence): the cp axis folded into fsdp, or into replica where the
    larger fsdp would no longer divide the experts. Serving drops no tokens: no capacity bound."""
    r, f, c = (layout.mesh.shape[a] for a in AXES)
    layout = dataclasses.replace(layout, ep_capacity=None)
    folded = dataclasses.replace(layout, mesh=Mesh(layout.mesh.devices.reshape(r, f * c, 1), AXES))
    if num_experts % folded.ep_size == 0:
        return folded
    return dataclasses.replace(layout, mesh=Mesh(layout.mesh.devices.reshape(r * c, f, 1), AXES))


def abstract_model_state(cfg: config_lib.ExperimentConfig, layout: Layout):
    """(graphdef, the whole model state as ShapeDtypeStructs with the layout's shardings)."""
    model = nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    shardings = layout.tree_shardings(logical_axes_of(state), state)
    return graphdef, with_shardings(shardings, state)


def abstract_cache(cfg: config_lib.ExperimentConfig, layout: Layout, slots: int, max_len: int):
    """The latent cache `init_cache` makes for `slots` rows, as ShapeDtypeStructs with the slot
    axis over the batch axes where they divide it."""
    shapes = jax.eval_shape(lambda: init_cache(cfg.model, cfg.model.num_layers, slots, max_len))
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=layout.sharding((None, "batch", None, None), x.shape)
        ),
        shapes,
    )


def abstract_inputs(layout: Layout, slots: int) -> DecodeInputs:
    """Per-slot decode inputs (stop tables at their smallest compiled size)."""

    def spec(dtype, *tail: int) -> jax.ShapeDtypeStruct:
        shape = (slots, *tail)
        names = ("batch",) + (None,) * len(tail)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=layout.sharding(names, shape))

    return DecodeInputs(
        tokens=spec(jnp.int32),
        positions=spec(jnp.int32),
        live=spec(jnp.bool_),
        temperature=spec(jnp.float32),
        top_p=spec(jnp.float32),
        seeds=spec(jnp.uint32),
        tokens_left=spec(jnp.int32),
        context_left=spec(jnp.int32),
        stops=spec(jnp.int32, MIN_STOP_TABLE, MIN_STOP_TABLE),
        history=spec(jnp.int32, MIN_STOP_TABLE),
    )


def plan_decode_step(
    cfg: config_lib.ExperimentConfig,
    layout: Layout | None = None,
    slots: int | None = None,
    max_len: int | None = None,
    absorbed: bool = True,
) -> DecodePlan:
    """Compiles one decode step of `slots` rows (default cfg.rl.rollout.num_slots, rounded up to a
    multiple of the devices: every device decodes whole rows) with caches of
    `max_len` tokens (default cfg.rl.rollout.context_len) on `layout`'s devices (`serving_layout`) and
    reads its costs."""
    if layout is None:
        layout = make_layout(config_lib.fitted_mesh(cfg, jax.device_count()))
    layout = serving_layout(layout, cfg.model.num_experts)
    rows = layout.mesh.shape["replica"] * layout.mesh.shape["fsdp"]
    if slots is None:
        slots = -(-cfg.rl.rollout.num_slots // rows) * rows
    if slots % rows:
        raise PlanError(f"--slots: {slots} decode rows do not split over {rows} devices")
    max_len = cfg.rl.rollout.context_len if max_len is None else max_len
    graphdef, state = abstract_model_state(cfg, layout)
    cache = abstract_cache(cfg, layout, slots, max_len)
    start = time.perf_counter()
    with use_layout(layout):
        lowered = decode_chunk.lower(
            graphdef, state, cache, abstract_inputs(layout, slots), 1, absorbed, max_len
        )
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    return DecodePlan(
        **costs.read_costs(compiled, dict(layout.mesh.shape), seconds),
        slots=slots,
        max_len=max_len,
        params_bytes=bytes_per_device(state),
        cache_bytes=bytes_per_device(cache),
    )


def render(plan: DecodePlan, device: DeviceSpec) -> str:
    """The decode plan and its estimate on `device` as one plain-text table."""
    mesh = " x ".join(f"{a}={n}" for a, n in plan.mesh.items())
    memory_s = (plan.params_bytes + plan.cache_bytes) / device.hbm_bytes_per_s
    step = max(costs.estimate(plan, device)["step_s_overlapped"], memory_s)
    return "\n".join(
        [
            f"decode step, {plan.slots} slots x {plan.max_len} tokens of cache, {plan.devices} "
            f"devices ({mesh}); compiled in {plan.compile_seconds:.1f} s",
            "per device",
            f"  weights             {costs.size(plan.params_bytes)}",
            f"  latent cache        {costs.size(plan.cache_bytes)}",
            *costs.render_costs(plan, device),
            f"reading the weights and the cache once takes {costs.duration(memory_s)} at "
            f"{device.name}'s HBM speed; at the slowest of the three the sampler makes at most "
            f"{plan.slots / step:,.0f} tokens/s over all slots",
        ]
    )
