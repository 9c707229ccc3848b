"""XLA flags and environment variables per GPU kind, each with the reason it is set.

The model scans its layer stacks (one while loop each) and shards state over `fsdp` inside a
replica (DESIGN.md section 4), so a training step is a loop of per-layer all-gathers (weights) and
reduce-scatters (gradients) around the layer's compute: the flags below make XLA overlap those
collectives with the compute of the neighbouring layer. Sources: JAX's "GPU performance tips",
OpenXLA's "GPU optimization levels" and NVIDIA JAX-Toolbox's "Tips for High-Performance LLMs
with JAX and XLA" (which also gives the Hopper / Blackwell differences). The all-reduce combine
threshold (HSDP's replica gradients) is left at XLA's default: a larger value trades overlap with
the backward pass for bandwidth, which only a measurement on the cluster can settle. No NCCL
variable is preset: NCCL's documentation keeps in scripts only the system-configuration ones
(network interfaces, HCAs), which depend on the cluster (`render --env=NCCL_SOCKET_IFNAME=...`),
and treats the rest as debugging workarounds (README, "Multi-host": NCCL_LAUNCH_MODE=GROUP).
`tests/test_cluster.py` starts JAX with every flag here: XLA aborts on an unknown flag or
value, and registers its GPU flags in CPU builds too (checked by hand on jaxlib 0.11.2, the
cluster's floor, as well).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str  # an XLA flag ("--xla_...") or an environment variable
    value: str
    reason: str


_COMBINE_BYTES = str(8 * 2**30)

_OVERLAP = (
    Setting(
        "--xla_gpu_enable_latency_hiding_scheduler",
        "true",
        "schedule collectives asynchronously, early enough to hide them behind independent "
        "compute (what jax_optimization_level=O1 turns on; explicit so it holds on every "
        "JAX >= 0.11.2 whatever that default is)",
    ),
    Setting(
        "--xla_gpu_enable_pipelined_all_gather",
        "true",
        "the scanned layer stack gathers layer i+1's fsdp-sharded weights during layer i",
    ),
    Setting(
        "--xla_gpu_enable_pipelined_reduce_scatter",
        "true",
        "layer i's gradient reduce-scatter runs during the backward pass of layer i-1",
    ),
    Setting(
        "--xla_gpu_enable_pipelined_all_reduce",
        "true",
        "the same for the all-reduces over the replica axis (HSDP gradients)",
    ),
    Setting(
        "--xla_gpu_enable_while_loop_double_buffering",
        "true",
        "unrolls each scanned stack by two, removing the loop barrier that would otherwise keep "
        "a pipelined collective from overlapping the next iteration's compute",
    ),
    Setting(
        "--xla_gpu_all_gather_combine_threshold_bytes",
        _COMBINE_BYTES,
        "combine all of a layer's weight gathers into one NCCL call: large buffers reach link "
        "bandwidth, many small ones are latency-bound (the threshold must exceed one layer's "
        "bf16 weights; NVIDIA's FSDP value)",
    ),
    Setting(
        "--xla_gpu_reduce_scatter_combine_threshold_bytes",
        _COMBINE_BYTES,
        "the same for one layer's gradient reduce-scatters",
    ),
)

_MEMORY = Setting(
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "0.9",
    "JAX preallocates 75% of GPU memory by default; 0.9 gives training the rest but for what "
    "NCCL, cuBLAS and cuDNN allocate outside XLA's pool",
)

PRESETS: dict[str, tuple[Setting, ...]] = {
    "h100": _OVERLAP
    + (
        _MEMORY,
        Setting(
            "CUDA_DEVICE_MAX_CONNECTIONS",
            "1",
            "one hardware queue per device, so kernels start in the order the latency-hiding "
            "scheduler chose; Hopper needs it for compute / communication overlap",
        ),
    ),
    "b200": _OVERLAP
    + (
        Setting(
            "--xla_gpu_enable_command_buffer",
            "FUSION,CUSTOM_CALL",
            "CUDA graphs for fusions and custom calls only: cuts the CPU launch overhead that "
            "Blackwell's faster kernels expose (NVIDIA's B200 setting)",
        ),
        _MEMORY,
        # No CUDA_DEVICE_MAX_CONNECTIONS=1: Blackwell lets high-priority (collective) streams
        # take SMs without waiting, and one queue is slower there.
    ),
}
PRESETS["h200"] = PRESETS["h100"]  # Same Hopper chip and NVLink 4; only memory size differs.

GPU_KINDS = tuple(sorted(PRESETS))


def settings(gpu: str) -> tuple[Setting, ...]:
    """The preset of a GPU kind; an unknown kind is a one-line ValueError."""
    if gpu not in PRESETS:
        raise ValueError(f"unknown GPU kind {gpu!r}; one of {', '.join(GPU_KINDS)}")
    return PRESETS[gpu]


def xla_flags(gpu: str) -> str:
    """The preset's XLA flags as one XLA_FLAGS value."""
    return " ".join(f"{s.name}={s.value}" for s in settings(gpu) if s.name.startswith("--"))


def environment(gpu: str) -> dict[str, str]:
    """Every environment variable the preset sets, XLA_FLAGS included."""
    env = {"XLA_FLAGS": xla_flags(gpu)}
    env.update({s.name: s.value for s in settings(gpu) if not s.name.startswith("--")})
    return env


def reasons(gpu: str) -> list[str]:
    """`NAME=VALUE: why` for each setting, for the comments of a rendered job."""
    return [f"{s.name}={s.value}: {s.reason}" for s in settings(gpu)]
