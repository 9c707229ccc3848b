"""The training step planned ahead of time: compiled for the config's mesh from ShapeDtypeStructs
that carry their shardings, so a 1T-parameter state costs no memory here.

Per device: parameter, optimizer-state and gradient bytes from the shardings; argument, output and
temporary bytes from XLA's memory analysis of the compiled module (its peak: arguments + outputs
- donated aliases + temporaries); collective bytes by kind and by mesh axes, and matmul FLOPs,
from one run of the module with loop trip counts applied (`parallel.hlo`). `estimate` turns them
into a step time for a named GPU: compute at the bf16 dense peak, each collective's wire bytes
((n-1)/n of what it produces, twice that for an all-reduce) over NVLink inside a domain and the
scale-out network across domains, with compute and communication either fully overlapped (the
lower bound) or serial (the upper bound).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import jax
import jax.numpy as jnp

from composer_jax import config as config_lib
from composer_jax.parallel import hlo
from composer_jax.parallel.mesh import AXES, Layout, make_layout
from composer_jax.parallel.report import bytes_per_device
from composer_jax.plan.devices import DeviceSpec
from composer_jax.train.loop import make_train_setup


@dataclasses.dataclass
class StepPlan:
    """What one training step of a config needs per device (bytes, FLOPs), from its compile."""

    devices: int
    mesh: dict[str, int]
    phase: str
    batch_size: int
    seq_len: int
    params_bytes: int
    optimizer_bytes: int
    buffers_bytes: int
    gradient_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops: float
    collective_bytes: dict[str, float]
    collective_count: dict[str, int]
    bytes_by_axes: dict[str, float]
    unknown_trip_loops: int
    compile_seconds: float
    dispatch: str  # the EP token exchange compiled: "padded" (worst-case buffers) or "ragged"
    collectives: list[hlo.Collective] = dataclasses.field(repr=False, default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs - donated aliases + temporaries: what the step holds at once."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def abstract_batch(layout: Layout, batch_size: int, seq_len: int) -> dict:
    """The packed batch a step takes, as ShapeDtypeStructs with the batch sharding."""
    sharding = layout.batch_sharding()
    spec = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=sharding)
    return {"tokens": spec, "positions": spec, "segment_ids": spec}


def _axes_of(collective: hlo.Collective, mesh: dict[str, int]) -> str:
    """The mesh axes a collective's group spans, matched by (size, span) against every subset
    of axes in the mesh's device order (the last axis fastest); "?" when none matches."""
    sizes = [mesh[a] for a in AXES]
    strides = [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]
    for count in range(1, len(AXES) + 1):
        for subset in itertools.combinations(range(len(AXES)), count):
            if any(sizes[i] == 1 for i in subset):
                continue
            size = math.prod(sizes[i] for i in subset)
            span = 1 + sum((sizes[i] - 1) * strides[i] for i in subset)
            if (size, span) == (collective.group_size, collective.group_span):
                return "+".join(AXES[i] for i in subset)
    return "?"


def plan_training_step(
    cfg: config_lib.ExperimentConfig, layout: Layout | None = None, phase: int = 0
) -> StepPlan:
    """Compiles the training step of `cfg`'s phase `phase` for `layout` (default: the config's
    mesh over every device) without allocating the state, and reads its costs."""
    if layout is None:
        layout = make_layout(config_lib.fitted_mesh(cfg, jax.device_count()))
    setup = make_train_setup(cfg, layout)
    p = cfg.train.phases[phase]
    start = time.perf_counter()
    compiled = (
        setup.jit_train_step()
        .lower(setup.abstract_state, abstract_batch(layout, p.batch_size, p.seq_len))
        .compile()
    )
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    costs = hlo.analyze(compiled.as_text())
    mesh = dict(layout.mesh.shape)
    by_axes: dict[str, float] = {}
    for c in costs.collectives:
        key = _axes_of(c, mesh)
        by_axes[key] = by_axes.get(key, 0.0) + c.bytes * c.executions
    state = setup.abstract_state
    params = bytes_per_device(state.params)
    return StepPlan(
        devices=layout.mesh.size,
        mesh=mesh,
        phase=p.name,
        batch_size=p.batch_size,
        seq_len=p.seq_len,
        params_bytes=params,
        optimizer_bytes=bytes_per_device(state.opt_state),
        buffers_bytes=bytes_per_device(state.buffers),
        gradient_bytes=params,  # gradients take the parameters' shapes, dtypes and shardings
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        flops=float(costs.dot_flops),
        collective_bytes=costs.bytes_by_kind(),
        collective_count=costs.count_by_kind(),
        bytes_by_axes=by_axes,
        unknown_trip_loops=costs.unknown_trip_loops,
        compile_seconds=seconds,
        dispatch=layout.dispatch_mode if layout.ep_size > 1 else "none",
        collectives=costs.collectives,
    )


# Bytes on the wire per byte a collective produces on each device, for a group of n.
def _wire_factor(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    return 2 * share if kind == "all-reduce" else share


def estimate(plan: StepPlan, device: DeviceSpec) -> dict[str, float]:
    """Seconds per step on `device`: compute, communication, and the step with the two fully
    overlapped (max) or serial (sum); whether the plan's peak fits the device's memory."""
    compute = plan.flops / device.bf16_flops
    comm = 0.0
    for c in plan.collectives:
        inside = c.group_span <= device.nvlink_domain
        bandwidth = device.nvlink_bytes_per_s / 2 if inside else device.scale_out_bytes_per_s
        comm += c.bytes * c.executions * _wire_factor(c.kind, c.group_size) / bandwidth
    return {
        "compute_s": compute,
        "communication_s": comm,
        "step_s_overlapped": max(compute, comm),
        "step_s_serial": compute + comm,
        "fits": float(plan.peak_bytes <= device.hbm_bytes),
    }


def _size(n: float) -> str:
    return f"{n / 2**30:10.3f} GiB" if n >= 2**30 else f"{n / 2**20:10.3f} MiB"


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def render(plan: StepPlan, device: DeviceSpec, title: str = "") -> str:
    """The plan and its estimate on `device` as one plain-text table."""
    t = estimate(plan, device)
    mesh = " x ".join(f"{a}={n}" for a, n in plan.mesh.items())
    fits = "fits" if t["fits"] else "does NOT fit"
    rows = [
        f"{title}training step, phase {plan.phase} (batch {plan.batch_size} x {plan.seq_len}), "
        f"{plan.devices} devices ({mesh}); compiled in {plan.compile_seconds:.1f} s",
        "per device",
        f"  parameters          {_size(plan.params_bytes)}",
        f"  optimizer state     {_size(plan.optimizer_bytes)}",
        f"  gradients           {_size(plan.gradient_bytes)}",
        f"  step arguments      {_size(plan.argument_bytes)}",
        f"  step temporaries    {_size(plan.temp_bytes)}",
        f"  step peak           {_size(plan.peak_bytes)}  ({fits} {device.name}'s "
        f"{device.hbm_bytes / 1e9:.0f} GB)",
        "collectives per step and device (bytes produced, executions)",
    ]
    for kind in sorted(plan.collective_bytes):
        rows.append(
            f"  {kind:<19} {_size(plan.collective_bytes[kind])} {plan.collective_count[kind]:7d}"
        )
    for axes in sorted(plan.bytes_by_axes):
        name = "pairs and other groups" if axes == "?" else axes
        rows.append(f"  over {name:<14} {_size(plan.bytes_by_axes[axes])}")
    rows += [
        f"matmul FLOPs per device {plan.flops:.4g}",
        f"on {device.name}: compute {_time(t['compute_s'])}, communication "
        f"{_time(t['communication_s'])}; a step takes {_time(t['step_s_overlapped'])} if they "
        f"overlap fully, {_time(t['step_s_serial'])} if not",
    ]
    if plan.dispatch == "padded":
        rows.append(
            "note: experts exchange tokens in padded worst-case buffers here (XLA:CPU compiles no "
            "ragged all-to-all), so all-to-all bytes and temporaries are upper bounds of a GPU "
            "run's"
        )
    if plan.unknown_trip_loops:
        rows.append(f"note: {plan.unknown_trip_loops} loop(s) of unknown trip count counted once")
    return "\n".join(rows)
