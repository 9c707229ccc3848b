"""The training step planned ahead of time: compiled for the config's mesh from ShapeDtypeStructs
that carry their shardings, so a 1T-parameter state costs no memory here.

Per device: parameter, optimizer-state and gradient bytes from the shardings, and what the
compiled step holds and exchanges (`costs`). When a step does not fit its GPU, the layout changes
that could help (`layout_knobs`) are each planned for real and ranked by peak (`rank_knobs`):
which knob helps most is measured, not guessed (remat can cost more than it saves on a small
model, and a mesh change moves both state and activations).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from composer_jax import config as config_lib
from composer_jax.parallel.mesh import Layout, make_layout
from composer_jax.parallel.report import bytes_per_device
from composer_jax.plan import costs
from composer_jax.plan.devices import DeviceSpec
from composer_jax.train.loop import make_train_setup


@dataclasses.dataclass(kw_only=True)
class StepPlan(costs.CompiledCosts):
    """What one training step of a config needs per device (bytes, FLOPs), from its compile."""

    phase: str
    batch_size: int
    seq_len: int
    params_bytes: int
    optimizer_bytes: int
    buffers_bytes: int
    gradient_bytes: int
    dispatch: str  # the EP token exchange compiled: "padded", "ragged", or "none" (no EP)
    capacity: float | None = None  # its bound per device pair (mesh.ep_capacity); None: dropless


def abstract_batch(layout: Layout, batch_size: int, seq_len: int) -> dict:
    """The packed batch a step takes, as ShapeDtypeStructs with the batch sharding."""
    sharding = layout.batch_sharding()
    spec = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=sharding)
    return {"tokens": spec, "positions": spec, "segment_ids": spec}


def plan_training_step(
    cfg: config_lib.ExperimentConfig,
    layout: Layout | None = None,
    phase: int = 0,
    *,
    verbose: bool = False,
) -> StepPlan:
    """Compiles the training step of `cfg`'s phase `phase` for `layout` (default: the config's
    mesh over every device) without allocating the state, and reads its costs. With `verbose`,
    Muon's split of the parameters is printed (once for a plan, not for each layout change)."""
    if layout is None:
        layout = make_layout(config_lib.fitted_mesh(cfg, jax.device_count()))
    setup = make_train_setup(cfg, layout, verbose=verbose)
    p = cfg.train.phases[phase]
    start = time.perf_counter()
    compiled = (
        setup.jit_train_step(microbatches=p.microbatches)
        .lower(setup.abstract_state, abstract_batch(layout, p.batch_size, p.seq_len))
        .compile()
    )
    seconds = time.perf_counter() - start
    state = setup.abstract_state
    params = bytes_per_device(state.params)
    return StepPlan(
        **costs.read_costs(compiled, dict(layout.mesh.shape), seconds),
        phase=p.name,
        batch_size=p.batch_size,
        seq_len=p.seq_len,
        params_bytes=params,
        optimizer_bytes=bytes_per_device(state.opt_state),
        buffers_bytes=bytes_per_device(state.buffers),
        gradient_bytes=params,  # gradients take the parameters' shapes, dtypes and shardings
        dispatch=layout.dispatch_mode if layout.ep_size > 1 else "none",
        capacity=layout.drop_capacity,
    )


@dataclasses.dataclass
class Knob:
    """One layout change tried on a plan: its override flags and the plan it gives (or why it
    could not be planned)."""

    flags: str
    plan: StepPlan | None
    error: str = ""
    config: config_lib.ExperimentConfig | None = dataclasses.field(default=None, repr=False)


def layout_knobs(
    cfg: config_lib.ExperimentConfig, devices: int, phase: int = 0
) -> list[tuple[str, object]]:
    """(flags, config) for each layout change that could lower a step's memory: layer
    rematerialisation, attention in key blocks (no [T, S] scores), a bounded expert exchange
    (capacity `config.PLANNED_EXPERT_CAPACITY` instead of worst-case buffers), twice the planned
    phase's micro-batches (gradient accumulation), the replica axis folded into fsdp (FSDP
    instead of HSDP), and twice or half the context parallelism; only changes that apply to
    `cfg`'s resolved mesh and model."""
    mesh = config_lib.fitted_mesh(cfg, devices)
    r, f, c = mesh.replica, mesh.fsdp, mesh.cp
    out = []
    if not cfg.model.remat:
        model = dataclasses.replace(cfg.model, remat=True)
        out.append(("--config.model.remat=True", dataclasses.replace(cfg, model=model)))
    if cfg.model.attention_block_size is None:
        block = config_lib.LONG_CONTEXT_ATTENTION_BLOCK
        model = dataclasses.replace(cfg.model, attention_block_size=block)
        out.append(
            (f"--config.model.attention_block_size={block}", dataclasses.replace(cfg, model=model))
        )
    ep_size = config_lib.ep_group_size(mesh, devices)
    if ep_size > 1 and mesh.ep_capacity is None and cfg.model.num_moe_layers:
        capacity = config_lib.PLANNED_EXPERT_CAPACITY
        bounded = dataclasses.replace(mesh, ep_capacity=capacity)
        out.append(
            (f"--config.mesh.ep_capacity={capacity}", dataclasses.replace(cfg, mesh=bounded))
        )
    planned = cfg.train.phases[phase]
    micro = 2 * planned.microbatches
    phases = list(cfg.train.phases)
    phases[phase] = dataclasses.replace(planned, microbatches=micro)
    train = dataclasses.replace(cfg.train, phases=tuple(phases))
    flag = f"--config.train.phases[{phase}].microbatches={micro}"
    out.append((flag, dataclasses.replace(cfg, train=train)))

    def with_mesh(replica: int, fsdp: int, cp: int) -> tuple[str, object]:
        flags = f"--config.mesh.replica={replica} --config.mesh.fsdp={fsdp} --config.mesh.cp={cp}"
        new = dataclasses.replace(mesh, replica=replica, fsdp=fsdp, cp=cp)
        return flags, dataclasses.replace(cfg, mesh=new)

    if r > 1:
        out.append(with_mesh(1, r * f, c))
    if f % 2 == 0:
        out.append(with_mesh(r, f // 2, 2 * c))
    if c % 2 == 0:
        out.append(with_mesh(r, 2 * f, c // 2))
    return out


def rank_knobs(
    cfg: config_lib.ExperimentConfig, devices: int, phase: int = 0, on_plan=None
) -> list[Knob]:
    """Re-plans `cfg` with each of `layout_knobs` (one compile each) and ranks the results by
    their peak memory per device, the plans that failed (a config the mesh cannot take) last.
    `on_plan(knob)` is called as each one finishes (progress)."""
    knobs = []
    for flags, changed in layout_knobs(cfg, devices, phase):
        try:
            config_lib.validate(changed, num_devices=devices)
            knob = Knob(flags, plan_training_step(changed, phase=phase), config=changed)
        except (config_lib.ConfigError, ValueError) as error:
            knob = Knob(flags, None, str(error).splitlines()[0], config=changed)
        knobs.append(knob)
        if on_plan is not None:
            on_plan(knob)
    return sorted(knobs, key=lambda k: (k.plan is None, k.plan.peak_bytes if k.plan else 0))


def search_knobs(
    cfg: config_lib.ExperimentConfig,
    base: StepPlan,
    device: DeviceSpec,
    devices: int,
    phase: int = 0,
    max_changes: int = 8,
    on_plan=None,
    on_keep=None,
) -> list[Knob]:
    """Layout changes combined greedily until the step fits `device`: each round re-plans every
    change that applies to the config so far (`rank_knobs`) and keeps the one with the lowest
    peak, if it lowers the peak. Returns the changes kept, in order, each with its plan; the
    last one fits unless no change lowered the peak further or `max_changes` were kept.
    `on_plan(knob)` and `on_keep(knob)` report each plan and each change kept (progress)."""
    chain: list[Knob] = []
    current, peak = cfg, base.peak_bytes
    while len(chain) < max_changes and peak > device.hbm_bytes:
        ranked = rank_knobs(current, devices, phase, on_plan)
        best = ranked[0] if ranked and ranked[0].plan is not None else None
        if best is None or best.plan.peak_bytes >= peak:
            break
        chain.append(best)
        current, peak = best.config, best.plan.peak_bytes
        if on_keep is not None:
            on_keep(best)
    return chain


def combined_flags(chain: list[Knob]) -> str:
    """The command-line overrides of a chain of changes, a later value of a field replacing an
    earlier one, in the order the fields were first changed."""
    merged: dict[str, str] = {}
    for knob in chain:
        for flag in knob.flags.split():
            merged[flag.split("=", 1)[0]] = flag
    return " ".join(merged.values())


def render_search(base: StepPlan, chain: list[Knob], device: DeviceSpec) -> str:
    """Each change of a search with the peak it reached, then the flags that reach the last."""
    rows = [
        f"layout changes combined (peak per device; the plan above: {costs.size(base.peak_bytes)})"
    ]
    for knob in chain:
        t = costs.estimate(knob.plan, device)
        fits = "fits" if t["fits"] else "does not fit"
        rows.append(
            f"  {costs.size(knob.plan.peak_bytes)} ({fits}; step "
            f"{costs.duration(t['step_s_overlapped'])}) + {knob.flags}"
        )
    if not chain:
        fits = base.peak_bytes <= device.hbm_bytes
        rows.append("  the step fits as it is" if fits else "  no layout change lowers the peak")
    elif chain[-1].plan.peak_bytes > device.hbm_bytes:
        rows.append("  no further change lowers the peak enough: plan with more devices")
    if chain:
        rows.append(f"flags: {combined_flags(chain)}")
    return "\n".join(rows)


def render_knobs(base: StepPlan, knobs: list[Knob], device: DeviceSpec) -> str:
    """The ranked knobs against the base plan: each one's peak, its change and its fit."""
    rows = [
        f"layout changes tried (peak per device; the plan above: {costs.size(base.peak_bytes)})"
    ]
    for knob in knobs:
        if knob.plan is None:
            rows.append(f"  cannot plan          {knob.flags}: {knob.error}")
            continue
        t = costs.estimate(knob.plan, device)
        change = (knob.plan.peak_bytes - base.peak_bytes) / base.peak_bytes
        fits = "fits" if t["fits"] else "does not fit"
        rows.append(
            f"  {costs.size(knob.plan.peak_bytes)} ({change:+.0%}, {fits}; step "
            f"{costs.duration(t['step_s_overlapped'])}) {knob.flags}"
        )
    return "\n".join(rows)


WORST_CASE_NOTE = (
    "note: the expert exchange is dropless, so its buffers hold the worst case (every token "
    "of a device bound for one member): all-to-all bytes and temporaries are upper bounds "
    "(padded) or receive buffers a GPU run holds too (ragged); --config.mesh.ep_capacity=C "
    "bounds them"
)


def capacity_note(capacity: float) -> str:
    return (
        f"note: the expert exchange is bounded (mesh.ep_capacity={capacity}): a device sends "
        f"each member at most {capacity}x an even share of its tokens and drops the rest"
    )


def render(plan: StepPlan, device: DeviceSpec, title: str = "") -> str:
    """The plan and its estimate on `device` as one plain-text table."""
    mesh = " x ".join(f"{a}={n}" for a, n in plan.mesh.items())
    rows = [
        f"{title}training step, phase {plan.phase} (batch {plan.batch_size} x {plan.seq_len}), "
        f"{plan.devices} devices ({mesh}); compiled in {plan.compile_seconds:.1f} s",
        "per device",
        f"  parameters          {costs.size(plan.params_bytes)}",
        f"  optimizer state     {costs.size(plan.optimizer_bytes)}",
        f"  gradients           {costs.size(plan.gradient_bytes)}",
        *costs.render_costs(plan, device),
    ]
    if plan.dispatch != "none":
        rows.append(WORST_CASE_NOTE if plan.capacity is None else capacity_note(plan.capacity))
    return "\n".join(rows)
