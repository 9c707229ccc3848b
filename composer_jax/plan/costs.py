"""What one compiled step holds and exchanges per device, read from the compiled module, and its
time on a named GPU.

Argument, output and temporary bytes come from XLA's memory analysis (the step's peak:
arguments + outputs - donated aliases + temporaries); collective bytes by kind and by mesh axes,
and matmul FLOPs, from one run over the module's HLO with loop trip counts applied
(`parallel.hlo`). `estimate` prices them on a GPU: compute at the bf16 dense peak, each
collective's wire bytes (a ring's: `_wire_factor`) over NVLink
inside a domain and over the scale-out network across domains, with compute and communication
either fully overlapped (the lower bound) or serial (the upper bound).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from composer_jax.parallel import hlo
from composer_jax.parallel.mesh import AXES
from composer_jax.plan.devices import DeviceSpec


@dataclasses.dataclass(kw_only=True)
class CompiledCosts:
    """Per device: the compiled step's memory, FLOPs and collectives, and its compile time."""

    devices: int
    mesh: dict[str, int]
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
    collectives: list[hlo.Collective] = dataclasses.field(repr=False, default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """Arguments + outputs - donated aliases + temporaries: what the step holds at once."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def axes_of(collective: hlo.Collective, mesh: dict[str, int]) -> str:
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


def read_costs(compiled, mesh: dict[str, int], compile_seconds: float) -> dict:
    """The `CompiledCosts` fields of a compiled step (a jax `Compiled`) on `mesh`."""
    memory = compiled.memory_analysis()
    analysis = hlo.analyze(compiled.as_text())
    by_axes: dict[str, float] = {}
    for c in analysis.collectives:
        key = axes_of(c, mesh)
        by_axes[key] = by_axes.get(key, 0.0) + c.bytes * c.executions
    return dict(
        devices=math.prod(mesh.values()),
        mesh=mesh,
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        flops=float(analysis.dot_flops),
        collective_bytes=analysis.bytes_by_kind(),
        collective_count=analysis.count_by_kind(),
        bytes_by_axes=by_axes,
        unknown_trip_loops=analysis.unknown_trip_loops,
        compile_seconds=compile_seconds,
        collectives=analysis.collectives,
    )


# Bytes a device sends (ring algorithms) per byte the collective produces on it, for a group of
# n: an all-gather or all-to-all sends (n - 1)/n of its output, an all-reduce twice that; a
# reduce-scatter produces 1/n of the input it sends (n - 1)/n of, so n - 1 times its output; a
# permute sends its whole buffer (its "group" is one pair).
def _wire_factor(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind == "collective-permute":
        return 1.0
    if kind == "reduce-scatter":
        return n - 1.0
    share = (n - 1) / n
    return 2 * share if kind == "all-reduce" else share


def estimate(costs: CompiledCosts, device: DeviceSpec) -> dict[str, float]:
    """Seconds per step on `device`: compute, communication, and the step with the two fully
    overlapped (max) or serial (sum); whether the step's peak fits the device's memory."""
    compute = costs.flops / device.bf16_flops
    comm = 0.0
    for c in costs.collectives:
        inside = c.group_span <= device.nvlink_domain
        bandwidth = device.nvlink_bytes_per_s / 2 if inside else device.scale_out_bytes_per_s
        comm += c.bytes * c.executions * _wire_factor(c.kind, c.group_size) / bandwidth
    return {
        "compute_s": compute,
        "communication_s": comm,
        "step_s_overlapped": max(compute, comm),
        "step_s_serial": compute + comm,
        "fits": float(costs.peak_bytes <= device.hbm_bytes),
    }


def size(n: float) -> str:
    return f"{n / 2**30:10.3f} GiB" if n >= 2**30 else f"{n / 2**20:10.3f} MiB"


def duration(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def render_costs(costs: CompiledCosts, device: DeviceSpec) -> list[str]:
    """Table rows shared by every plan: the peak and its fit, collectives by kind and by mesh
    axes, FLOPs and the time on `device`."""
    t = estimate(costs, device)
    fits = "fits" if t["fits"] else "does NOT fit"
    rows = [
        f"  step arguments      {size(costs.argument_bytes)}",
        f"  step temporaries    {size(costs.temp_bytes)}",
        f"  step peak           {size(costs.peak_bytes)}  ({fits} {device.name}'s "
        f"{device.hbm_bytes / 1e9:.0f} GB)",
        "collectives per step and device (bytes produced, executions)",
    ]
    for kind in sorted(costs.collective_bytes):
        rows.append(
            f"  {kind:<19} {size(costs.collective_bytes[kind])} {costs.collective_count[kind]:7d}"
        )
    for axes in sorted(costs.bytes_by_axes):
        name = "other groups" if axes == "?" else axes
        rows.append(f"  over {name:<14} {size(costs.bytes_by_axes[axes])}")
    rows += [
        f"matmul FLOPs per device {costs.flops:.4g}",
        f"on {device.name}: compute {duration(t['compute_s'])}, communication "
        f"{duration(t['communication_s'])}; a step takes {duration(t['step_s_overlapped'])} if "
        f"they overlap fully, {duration(t['step_s_serial'])} if not",
    ]
    if costs.unknown_trip_loops:
        rows.append(f"note: {costs.unknown_trip_loops} loop(s) of unknown trip count counted once")
    return rows
