r"""The training step and the sampler's decode step planned ahead of time on N virtual devices:
memory, collectives and time per device, without allocating the model (composer_jax.plan).

  python -m launch.plan --config=tiny --devices=8
  python -m launch.plan --config=kimi_k2 --devices=256 --device=H200 [--config.mesh.fsdp=...]
  python -m launch.plan --config=kimi_k2 --devices=256 --steps=train --knobs=always
  python -m launch.plan --config=kimi_k2 --devices=256 --steps=train --buffers=10
  python -m launch.plan --config=kimi_k2 --devices=512 --steps=train --knobs=search

The steps are compiled for CPU devices standing in for the GPUs (XLA's CPU SPMD partitioner makes
the same collectives; kernels and fusion differ), so memory is what the partitioned program
holds, and time is an estimate from the named GPU's datasheet peaks (the table says how). When
the training step does not fit the GPU (or with --knobs=always), each layout change that could
help (remat, attention in key blocks, micro-batches, FSDP instead of HSDP, more or less context
parallelism, a bounded expert exchange) is planned too and ranked by its peak; --knobs=search
combines the best of them one at a time until the step fits. --buffers=N lists
what holds the training step's peak: XLA's N largest allocations and the ops that made them.
"""

import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from absl import flags

from composer_jax.plan import buffers
from launch import cli

# The command line as given: defining --config takes the typed overrides (tuples such as
# --config.mesh.ep) out of sys.argv, and the compiling child must get them too.
_ARGV = list(sys.argv[1:])
_CONFIG = cli.define_config("tiny")
_DEVICES = flags.DEFINE_integer("devices", 8, "Virtual devices to plan for (the mesh's size).")
_DEVICE = flags.DEFINE_string("device", "H200", "GPU whose datasheet prices the plan.")
_PHASE = flags.DEFINE_integer("phase", 0, "Training phase whose batch shape is planned.")
_STEPS = flags.DEFINE_list("steps", ["train", "decode"], "Steps to plan: train, decode.")
_SLOTS = flags.DEFINE_integer(
    "slots",
    None,
    "Decode rows (default: rl.rollout.num_slots rounded up to a multiple of the devices).",
    lower_bound=1,
)
_KNOBS = flags.DEFINE_enum(
    "knobs",
    "auto",
    ["auto", "always", "never", "search"],
    "Re-plan the training step with each layout change and rank them (auto: when it does not "
    "fit); search: combine the best changes one at a time until it fits.",
)
_BUFFERS = flags.DEFINE_integer(
    "buffers", 0, "List the training step's N largest allocations and the ops that made them."
)
MAX_DEVICES = 4096  # XLA's CPU client makes each virtual device a thread pool; more is unusable


def _simulate(devices: int, dump_to: str | None) -> None:
    """Sets up `devices` CPU devices (and the training step's buffer dump into `dump_to`);
    must run before JAX is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("launch.plan must choose the device count before JAX is imported")
    flags_now = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags_now.append(f"--xla_force_host_platform_device_count={devices}")
    if dump_to is not None:
        flags_now += buffers.dump_flags(dump_to, "train_step")
        # A step loaded from JAX's compilation cache is not compiled, so nothing is dumped.
        os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    # XLA:CPU's fusion emitters divide by zero on some fusions of the 1T step (SIGFPE, jaxlib
    # 0.11.2 and 0.12, at 8 to 256 devices): elementwise fusions go to its YNNPACK library path
    # next to the dots (the default), and on jaxlib 0.12 the tiled emitter takes its older
    # lowering. Both change CPU code generation only: the partitioned program, its collectives
    # and its FLOPs are the same.
    flags_now.append(f"--xla_cpu_experimental_ynn_fusion_type={YNN_FUSIONS}")
    jaxlib = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])
    if jaxlib >= (0, 12):
        flags_now.append("--xla_cpu_use_new_xtile_lowering=false")
    os.environ["XLA_FLAGS"] = " ".join(flags_now)
    os.environ["JAX_PLATFORMS"] = "cpu"


CHILD = "CJ_PLAN_CHILD"
YNN_FUSIONS = "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE"


def _compile_in_child() -> None:
    """Runs this command again in a child, so a crash of XLA's CPU compiler (a signal, not an
    exception) ends the plan with one line instead of a native stack."""
    child = subprocess.run(
        [sys.executable, "-m", "launch.plan", *_ARGV],
        env=dict(os.environ, **{CHILD: "1"}),
        stderr=subprocess.PIPE,
        text=True,
    )
    if child.returncode >= 0:
        sys.stderr.write(_summarise_xla_warnings(child.stderr))
    else:
        name = signal.Signals(-child.returncode).name
        cli.fail(
            f"XLA's CPU compiler crashed ({name}) compiling this plan: try another --devices or "
            "mesh",
            status=1,
        )
    sys.exit(child.returncode)


_REMAT_WARNING = "Involuntary full rematerialization"


def _summarise_xla_warnings(stderr: str) -> str:
    """The child's stderr with XLA's repeated resharding warnings (one per HLO operation the SPMD
    partitioner had to replicate to reshard) counted in one line."""
    lines = stderr.splitlines(keepends=True)
    kept = [line for line in lines if _REMAT_WARNING not in line]
    count = len(lines) - len(kept)
    if count:
        kept.append(
            f"note: XLA's SPMD partitioner replicated {count} tensor(s) to reshard them "
            f"('{_REMAT_WARNING}'): resharding this layout does not do efficiently\n"
        )
    return "".join(kept)


def main(argv):
    del argv
    if not os.environ.get(CHILD):
        _compile_in_child()
    if not 1 <= _DEVICES.value <= MAX_DEVICES:
        cli.fail(f"--devices: {_DEVICES.value} cannot be simulated here (1 to {MAX_DEVICES})")
    cfg = cli.experiment_config(_CONFIG)
    from composer_jax.plan import devices

    try:
        device = devices.by_name(_DEVICE.value.upper())
    except ValueError as error:
        cli.fail(f"--device: {error}")
    if not 0 <= _PHASE.value < len(cfg.train.phases):
        cli.fail(f"--phase: the config has phases 0 to {len(cfg.train.phases) - 1}")
    if _BUFFERS.value < 0:
        cli.fail(f"--buffers: {_BUFFERS.value} is not a count of allocations")
    dump_to = tempfile.mkdtemp(prefix="plan-buffers-") if _BUFFERS.value else None
    _simulate(_DEVICES.value, dump_to)
    try:
        _plan(cfg, device, dump_to)
    finally:
        if dump_to is not None:
            shutil.rmtree(dump_to, ignore_errors=True)


def _plan(cfg, device, dump_to: str | None) -> None:
    from composer_jax import config as config_lib
    from composer_jax.plan import decode

    unknown = set(_STEPS.value) - {"train", "decode"}
    if unknown:
        cli.fail(f"--steps: unknown step {sorted(unknown)[0]!r}; known: train, decode")
    try:
        config_lib.validate(cfg, num_devices=_DEVICES.value)
    except config_lib.ConfigError as error:
        cli.fail(str(error))
    if "train" in _STEPS.value:
        _plan_training(cfg, device, dump_to)
    if "decode" in _STEPS.value:
        try:
            plan = decode.plan_decode_step(cfg, slots=_SLOTS.value)
        except decode.PlanError as error:
            cli.fail(str(error))
        print(decode.render(plan, device), flush=True)


def _plan_training(cfg, device, dump_to: str | None) -> None:
    # Imported here, not at the top: JAX must see the simulated device count first (_simulate).
    from composer_jax.plan import costs, training

    plan = training.plan_training_step(cfg, phase=_PHASE.value, verbose=True)
    print(training.render(plan, device), flush=True)
    if dump_to is not None:
        allocations = buffers.read_dump(dump_to)
        print(buffers.render(allocations, _BUFFERS.value, costs.size), flush=True)
    fits = costs.estimate(plan, device)["fits"]
    progress = lambda k: print(f"  planned {k.flags}", file=sys.stderr, flush=True)  # noqa: E731
    if _KNOBS.value == "search":
        chain = training.search_knobs(
            cfg,
            plan,
            device,
            _DEVICES.value,
            _PHASE.value,
            on_plan=progress,
            on_keep=lambda k: print(
                f"kept {k.flags}: {costs.size(k.plan.peak_bytes)}", file=sys.stderr, flush=True
            ),
        )
        print(training.render_search(plan, chain, device), flush=True)
    elif _KNOBS.value == "always" or (_KNOBS.value == "auto" and not fits):
        knobs = training.rank_knobs(
            cfg,
            _DEVICES.value,
            _PHASE.value,
            on_plan=progress,
        )
        print(training.render_knobs(plan, knobs, device), flush=True)


if __name__ == "__main__":
    cli.run(main)
