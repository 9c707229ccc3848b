r"""Roofline model of one training step: where the time must go on a given GPU, and the best MFU.

For a model config, a per-device batch and a device spec (`composer_jax/plan/devices.py`), the step
is split into four kinds of work, each timed at its roof:
  GEMM          matmul FLOPs at the tensor-core peak of the format that runs them (routed experts
                at the expert precision's formats, everything else bf16);
  attention     scores and weighted values (`model/accounting.py`) at the bf16 peak;
  memory-bound  HBM bytes of elementwise work, norms, quantization and the optimizer update;
  communication bytes each device sends over NVLink (FSDP gathers and gradient reduce-scatter,
                expert-parallel all-to-all), at one direction's bandwidth.
Tensor-core and memory-bound kernels run one after another; communication can hide under them, so
the best step time is max(GEMM + attention + memory, communication). MFU counts the model FLOPs
(6 x active matmul parameters + 3 x attention forward, per token) against the dense bf16 peak,
the usual convention, whatever formats the GEMMs run in.

The byte counts are a stated model, not a measurement: see the constants below. Read a measured
step time against `Prediction.overlapped_s`; the gap is what kernels and scheduling leave.

  python experiments/roofline.py [--preset=small] [--device=H200] [--seq_len=2048]
      [--batch=8] [--expert_precision=bf16] [--devices=1]
"""

from __future__ import annotations

import dataclasses

# HBM bytes per parameter of the AdamW update: read and write fp32 master, first and second
# moments (24), read the fp32 gradient (4), write the bf16 compute copy (2), rounded up.
OPTIMIZER_BYTES_PER_PARAM = 32
# Elementwise HBM traffic per token per layer, in units of `hidden_size` bf16 values: the two
# RMSNorms, two residual adds, RoPE and the router read and write the hidden state about a dozen
# times forward and twice that backward.
ELEMENTWISE_HIDDEN_PASSES = 36
# Per routed slot: SwiGLU reads gate and up and writes the product (3 x intermediate) forward,
# about twice that backward; gathers/scatters of the sorted rows move the hidden state 4x.
EXPERT_INTERMEDIATE_PASSES = 9
EXPERT_HIDDEN_PASSES = 4
# Quantizing an operand element: read bf16 (2) and write a code with its share of scale (~1).
QUANT_BYTES_PER_ELEMENT = 3

# Fraction of the routed-expert FLOPs in the forward pass (fwd : dgrad : wgrad = 1 : 1 : 1).
_FORWARD_SHARE = 1 / 3
# The MMA formats each expert recipe runs (forward, backward); Hopper has no FP4 MMA and runs the
# NVFP4 forward as bf16 on codes x block scales, as this project's Hopper kernels do.
_EXPERT_FORMATS = {
    "bf16": ("bf16", "bf16"),
    "mxfp8": ("fp8", "fp8"),
    "nvfp4_fwd_mxfp8_bwd": ("fp4", "fp8"),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """One training step on one device."""

    tokens: int
    expert_flops: float  # routed-expert GEMMs, forward + backward
    dense_flops: float  # every other matmul (attention projections, dense/shared MLPs, head, MTP)
    attention_flops: float  # scores and weighted values, forward + backward
    memory_bytes: float  # HBM traffic of memory-bound kernels
    comm_bytes: float  # bytes sent per device
    model_flops: float  # MFU numerator: equals expert + dense + attention FLOPs


@dataclasses.dataclass(frozen=True)
class Prediction:
    gemm_s: float
    attention_s: float
    memory_s: float
    comm_s: float
    serial_s: float  # nothing overlaps
    overlapped_s: float  # communication hidden under the rest
    best_mfu: float  # model FLOPs / (overlapped_s x bf16 peak)

    def rows(self) -> list[tuple[str, float, float]]:
        """(part, seconds, share of the serial time)."""
        parts = [
            ("GEMM", self.gemm_s),
            ("attention", self.attention_s),
            ("memory-bound", self.memory_s),
            ("communication", self.comm_s),
        ]
        return [(name, s, s / self.serial_s if self.serial_s else 0.0) for name, s in parts]


def _peak_or_bf16(device, fmt: str) -> float:
    peak = device.peak(fmt)
    return peak if peak is not None else device.peak("bf16")


def predict(work: Workload, device, expert_precision: str = "bf16") -> Prediction:
    """Roofline times of `work` on `device` (a `devices.DeviceSpec`)."""
    if expert_precision not in _EXPERT_FORMATS:
        raise ValueError(f"expert_precision must be one of {sorted(_EXPERT_FORMATS)}")
    fwd_fmt, bwd_fmt = _EXPERT_FORMATS[expert_precision]
    bf16 = device.peak("bf16")
    expert_s = work.expert_flops * _FORWARD_SHARE / _peak_or_bf16(device, fwd_fmt)
    expert_s += work.expert_flops * (1 - _FORWARD_SHARE) / _peak_or_bf16(device, bwd_fmt)
    gemm_s = expert_s + work.dense_flops / bf16
    attention_s = work.attention_flops / bf16
    memory_s = work.memory_bytes / device.hbm_bytes_per_s
    comm_s = work.comm_bytes / (device.nvlink_bytes_per_s / 2)
    on_chip = gemm_s + attention_s + memory_s
    overlapped = max(on_chip, comm_s)
    return Prediction(
        gemm_s=gemm_s,
        attention_s=attention_s,
        memory_s=memory_s,
        comm_s=comm_s,
        serial_s=on_chip + comm_s,
        overlapped_s=overlapped,
        best_mfu=work.model_flops / (overlapped * bf16) if overlapped else 0.0,
    )


def workload(
    cfg, seq_len: int, batch_per_device: int, expert_precision: str = "bf16", devices: int = 1
) -> Workload:
    """The step of `cfg` (a ModelConfig) for `batch_per_device` sequences on each of `devices`
    GPUs of one NVLink domain, parameters FSDP-sharded and experts spread over all of them."""
    from composer_jax.model import accounting

    counts = accounting.count_params(cfg)
    tokens = seq_len * batch_per_device
    routed_active = counts.routed_experts * cfg.num_experts_per_tok / max(cfg.num_experts, 1)
    dense_params = counts.active - counts.embedding - routed_active
    attention = 3.0 * accounting.attention_flops_per_token(cfg, seq_len) * tokens
    routed_slots = tokens * cfg.num_experts_per_tok * cfg.num_moe_layers

    act_bytes = 2 * tokens * cfg.hidden_size * cfg.num_layers * ELEMENTWISE_HIDDEN_PASSES
    act_bytes += 2 * routed_slots * cfg.moe_intermediate_size * EXPERT_INTERMEDIATE_PASSES
    act_bytes += 2 * routed_slots * cfg.hidden_size * EXPERT_HIDDEN_PASSES
    opt_bytes = OPTIMIZER_BYTES_PER_PARAM * counts.total / devices
    quant_bytes = 0.0
    if expert_precision != "bf16":
        # Each of the three expert GEMMs quantizes its two activation-sized operands once per
        # pass (forward, dgrad, wgrad); the weights are a small share at these token counts.
        per_slot = cfg.hidden_size + cfg.moe_intermediate_size
        quant_bytes = QUANT_BYTES_PER_ELEMENT * routed_slots * per_slot * 3 * 3

    comm = 0.0
    if devices > 1:
        ring = (devices - 1) / devices
        # FSDP: bf16 all-gather forward and backward, fp32 gradient reduce-scatter.
        comm += counts.total * (2 + 2 + 4) * ring / devices
        # EP: fp8 dispatch and bf16 combine forward, the reverse twice backward.
        comm += routed_slots * cfg.hidden_size * (1 + 2) * 3 * ring
    return Workload(
        tokens=tokens,
        expert_flops=6.0 * routed_active * tokens,
        dense_flops=6.0 * dense_params * tokens,
        attention_flops=attention,
        memory_bytes=act_bytes + opt_bytes + quant_bytes,
        comm_bytes=comm,
        model_flops=accounting.train_flops_per_token(cfg, seq_len) * tokens,
    )


def format_prediction(pred: Prediction, work: Workload) -> str:
    lines = [f"{'part':<15}{'ms':>10}{'share':>8}"]
    for name, seconds, share in pred.rows():
        lines.append(f"{name:<15}{seconds * 1e3:>10.3f}{share:>7.1%}")
    lines.append(f"{'serial':<15}{pred.serial_s * 1e3:>10.3f}")
    lines.append(f"{'overlapped':<15}{pred.overlapped_s * 1e3:>10.3f}")
    lines.append(
        f"best MFU {pred.best_mfu:.1%}; {work.tokens / pred.overlapped_s:,.0f} tokens/s at best"
    )
    return "\n".join(lines)


def main(argv):
    del argv
    from absl import flags

    from composer_jax import presets
    from composer_jax.plan import devices

    f = flags.FLAGS
    cfg = presets.PRESETS[f.preset]().model
    device = devices.by_name(f.device)
    work = workload(cfg, f.seq_len, f.batch, f.expert_precision, f.devices)
    print(
        f"{f.preset} on {f.devices} x {device.name}: {f.batch} x {f.seq_len} tokens per device, "
        f"experts {f.expert_precision}"
    )
    print(format_prediction(predict(work, device, f.expert_precision), work))


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("preset", "small", "Model preset.")
    flags.DEFINE_string("device", "H200", "Device spec name (composer_jax/plan/devices.py).")
    flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence.")
    flags.DEFINE_integer("batch", 8, "Sequences per device per step.")
    flags.DEFINE_string("expert_precision", "bf16", "bf16 | mxfp8 | nvfp4_fwd_mxfp8_bwd.")
    flags.DEFINE_integer("devices", 1, "GPUs in the NVLink domain sharing the step.")
    app.run(main)
