"""Grouped-GEMM cases of the GPU check: one backend on one expert shape per case.

Every case checks its result against a float32 reference on the same (quantized) operands before
timing it; kernel cases time the kernel alone (operands quantized beforehand), the `quantize_*`
and `moe_op_*` cases time quantization alone and quantization + kernel end to end. The peak a
case is measured against is that of the MMA format it actually runs (fp8 for MXFP8 kernels, fp4
for Blackwell NVFP4, bf16 for Hopper's NVFP4 path, which multiplies codes x scales in bf16).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from composer_jax.plan import devices
from experiments.gpu import timing

# DeepSeek-V3 / Kimi-K2 experts: hidden 7168, expert width 2048; 8 of 256 (or 384) experts per
# token, so under expert parallelism a GPU holds 8 (or 12) experts.
SHAPES = [
    dict(name="up_7168x2048_e8_t1024", k=7168, n=2048, experts=8, per_expert=1024, routing="balanced"),
    dict(name="up_7168x2048_e8_t1024_skew", k=7168, n=2048, experts=8, per_expert=1024, routing="skewed"),
    dict(name="up_7168x2048_e8_t128", k=7168, n=2048, experts=8, per_expert=128, routing="balanced"),
    dict(name="up_7168x2048_e8_t4096", k=7168, n=2048, experts=8, per_expert=4096, routing="balanced"),
    dict(name="down_2048x7168_e8_t1024", k=2048, n=7168, experts=8, per_expert=1024, routing="balanced"),
    dict(name="up_7168x2048_e12_t512_skew", k=7168, n=2048, experts=12, per_expert=512, routing="skewed"),
]  # fmt: skip
DRY_SHAPES = [
    dict(name="dry_128x64_e4_t40", k=128, n=64, experts=4, per_expert=40, routing="balanced"),
    dict(name="dry_128x128_e4_t40_skew", k=128, n=128, experts=4, per_expert=40, routing="skewed"),
]
BACKENDS = [
    "ragged_dot_bf16",
    "hopper_bf16",
    "hopper_bf16_persistent",
    "hopper_bf16_ws",
    "jax_ragged_dot_mgpu",
    "hopper_mxfp8",
    "hopper_nvfp4",
    "blackwell_mxfp8",
    "blackwell_mxfp8_persistent",
    "blackwell_mxfp8_2cta",
    "blackwell_nvfp4",
    "blackwell_nvfp4_persistent",
    "blackwell_nvfp4_2cta",
    "jax_blackwell_ragged_dot_mgpu",
    "xla_wgrad_bf16",
    "hopper_wgrad",
    "blackwell_wgrad_mxfp8",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "moe_op_nvfp4_hopper",
    "moe_op_nvfp4_blackwell",
]


class NotAvailable(Exception):
    """The case cannot run here; the message says why (reported as "n/a: why")."""


def group_sizes(experts: int, per_expert: int, routing: str) -> tuple[np.ndarray, int]:
    """(group sizes, rows). Skewed: one empty and one tiny group, the rest geometric, and a few
    rows past the groups (the padded tail an expert-parallel buffer has)."""
    total = experts * per_expert
    if routing == "balanced":
        return np.full(experts, per_expert, np.int32), total
    if routing != "skewed":
        raise ValueError(f"routing must be balanced or skewed, got {routing!r}")
    weights = np.concatenate([[0.0, 0.002], 1.6 ** np.arange(experts - 2)])
    sizes = np.floor(total * weights / weights.sum()).astype(np.int32)
    sizes[1] = max(sizes[1], 1)
    sizes[-1] += total - sizes.sum()
    return sizes, total + max(total // 32, 3)


@functools.lru_cache(maxsize=2)
def _inputs(k: int, n: int, experts: int, per_expert: int, routing: str):
    import jax
    import jax.numpy as jnp

    sizes, rows = group_sizes(experts, per_expert, routing)
    keys = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(keys[0], (rows, k), jnp.float32).astype(jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (experts, k, n)) / k**0.5).astype(jnp.bfloat16)
    grad = jax.random.normal(keys[2], (rows, n), jnp.float32).astype(jnp.bfloat16)
    return lhs, rhs, grad, jnp.asarray(sizes)


def _arch(device_name: str | None, dry_run: bool) -> str:
    if dry_run:
        return "cpu"
    if device_name in ("H100", "H200"):
        return "hopper"
    if device_name in ("B200", "GB200"):
        return "blackwell"
    return "other"


def _needs(arch: str, wanted: str) -> None:
    if arch not in (wanted, "cpu"):
        sm = {"hopper": "sm_90 (H100/H200) wgmma", "blackwell": "sm_100 (B200) tcgen05"}[wanted]
        raise NotAvailable(f"needs {sm}; this device is {arch}")


def _quantized(lhs, rhs, fmt: str):
    """Operands quantized along K: lhs [M, K], rhs [E, K, N]."""
    from composer_jax.quant import formats

    if fmt == "mxfp8":
        return formats.quantize_mxfp8(lhs, axis=1), formats.quantize_mxfp8(rhs, axis=1)
    return formats.quantize_nvfp4(lhs, axis=1), formats.quantize_nvfp4(rhs, axis=1)


@dataclasses.dataclass(frozen=True)
class _Operands:
    """One shape's bf16 operands and the device a backend is built for. Persistent kernels
    launch at most `num_sms` CTAs."""

    lhs: Any
    rhs: Any
    grad: Any
    sizes: Any
    arch: str
    dry_run: bool
    num_sms: int

    def reference(self, lhs=None, rhs=None):
        from kernels_pallas import grouped_layout

        return grouped_layout.grouped_gemm_reference(
            self.lhs if lhs is None else lhs, self.rhs if rhs is None else rhs, self.sizes
        )

    def lower_or_run(self) -> str:
        """Kernels interpret mode cannot run are lowered for cuda in a dry run."""
        return "lower" if self.dry_run else "run"


@dataclasses.dataclass(frozen=True)
class _Built:
    """A backend ready to check and time: `fn(*args)` against `want`, measured against the peak
    of the MMA format it runs; `how` is "run" or "lower" (lowered for cuda only)."""

    fn: Callable
    args: tuple
    want: Any
    mma_format: str
    how: str = "run"


# The registry of GEMM backends: name -> builder(_Operands) -> _Built, raising NotAvailable where
# the device cannot run it. Builders import JAX and the kernels when called: the check's parent
# process imports this module for the plan alone and must not start JAX on the GPU.
_BUILDERS: dict[str, Callable[[_Operands], _Built]] = {}


def _registers(*names: str):
    def register(builder):
        for name in names:
            _BUILDERS[name] = functools.partial(builder, name=name)
        return builder

    return register


@_registers("ragged_dot_bf16")
def _ragged_dot(ops: _Operands, name: str) -> _Built:
    import jax

    return _Built(jax.lax.ragged_dot, (ops.lhs, ops.rhs, ops.sizes), ops.reference(), "bf16")


@_registers("hopper_bf16", "hopper_bf16_persistent", "hopper_bf16_ws")
def _hopper_bf16(ops: _Operands, name: str) -> _Built:
    """The Hopper kernel: one CTA per tile, persistent, or warp-specialized (a producer and two
    consumer warpgroups on 128 x 256 tiles)."""
    import jax.numpy as jnp

    from kernels_pallas import hopper_grouped_gemm, hopper_warp_specialized

    _needs(ops.arch, "hopper")
    options = dict(out_dtype=jnp.bfloat16, interpret=ops.dry_run)
    if name == "hopper_bf16_ws":
        fn = functools.partial(hopper_warp_specialized.grouped_gemm, **options)
    else:
        num_sms = ops.num_sms if name == "hopper_bf16_persistent" else None
        fn = functools.partial(hopper_grouped_gemm.grouped_gemm, num_sms=num_sms, **options)
    return _Built(fn, (ops.lhs, ops.rhs, ops.sizes), ops.reference(), "bf16")


@_registers("jax_ragged_dot_mgpu")
def _jax_hopper_ragged_dot(ops: _Operands, name: str) -> _Built:
    import jax.numpy as jnp

    _needs(ops.arch, "hopper")
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except ImportError as err:
        raise NotAvailable(f"JAX's Mosaic GPU ragged_dot example is missing: {err}") from err
    block = 64 if ops.dry_run else 128
    kernel = functools.partial(
        ragged_dot_mgpu.ragged_dot,
        block_m=block,
        block_n=block,
        block_k=64,
        max_concurrent_steps=4,
        grid_block_n=1,
    )
    # Its TMA reads need whole 8-row groups; it leaves rows past the groups unwritten.
    lhs8 = jnp.pad(ops.lhs, ((0, -ops.lhs.shape[0] % 8), (0, 0)))
    return _Built(
        lambda a, b, s: kernel(a, b, group_sizes=s),
        (lhs8, ops.rhs, ops.sizes),
        ops.reference(),
        "bf16",
        ops.lower_or_run(),
    )


@_registers("jax_blackwell_ragged_dot_mgpu")
def _jax_blackwell_ragged_dot(ops: _Operands, name: str) -> _Built:
    _needs(ops.arch, "blackwell")
    if ops.dry_run:
        raise NotAvailable("JAX's example reads the SM count from a local GPU: no CPU lowering")
    try:
        from jax.experimental.pallas.ops.gpu import blackwell_matmul_mgpu as bmm
        from jax.experimental.pallas.ops.gpu import blackwell_ragged_dot_mgpu as brd
    except ImportError as err:
        raise NotAvailable(f"JAX's Blackwell ragged_dot example is missing: {err}") from err
    config = brd.TuningConfig(
        tile_m=128,
        tile_n=128,
        tile_k=64,
        max_concurrent_steps=4,
        collective=True,
        grid_tile_width=8,
        grid_minor_dim=bmm.MatmulDimension.N,
    )
    fn = functools.partial(brd.ragged_dot_kernel, config=config)
    return _Built(fn, (ops.lhs, ops.rhs, ops.sizes), ops.reference(), "bf16")


def _block_scaled(ops: _Operands, fmt: str):
    """(lhs and rhs quantized along K, the reference on the same quantized operands, NVFP4's
    per-row and per-column tensor scales or ())."""
    from composer_jax.quant import formats
    from kernels_pallas import grouped_layout

    lhs_q, rhs_q = _quantized(ops.lhs, ops.rhs, fmt)
    if fmt == "mxfp8":
        return lhs_q, rhs_q, ops.reference(formats.dequantize(lhs_q), formats.dequantize(rhs_q)), ()
    lhs_row, rhs_col = lhs_q.row_scales[:, 0], rhs_q.row_scales[:, 0, :]
    want = ops.reference(
        formats.dequantize_nvfp4_unscaled(lhs_q), formats.dequantize_nvfp4_unscaled(rhs_q)
    )
    expert = grouped_layout.expert_of_row(ops.sizes, ops.lhs.shape[0])
    return lhs_q, rhs_q, want * lhs_row[:, None] * rhs_col[expert], (lhs_row, rhs_col)


def _kernel_codes(lhs_q, rhs_q) -> tuple:
    """The block-scaled kernels' operands: lhs codes and scales, rhs's with N before K."""
    import jax.numpy as jnp

    rhs_t = (jnp.swapaxes(rhs_q.values, 1, 2), jnp.swapaxes(rhs_q.scales, 1, 2))
    return (lhs_q.values, lhs_q.scales, *rhs_t)


@_registers("hopper_mxfp8")
def _hopper_mxfp8(ops: _Operands, name: str) -> _Built:
    from kernels_pallas import hopper_grouped_gemm

    _needs(ops.arch, "hopper")
    lhs_q, rhs_q, want, _ = _block_scaled(ops, "mxfp8")
    fn = functools.partial(hopper_grouped_gemm.mxfp8_grouped_gemm, interpret=ops.dry_run)
    return _Built(fn, (*_kernel_codes(lhs_q, rhs_q), ops.sizes), want, "fp8")


@_registers("hopper_nvfp4")
def _hopper_nvfp4(ops: _Operands, name: str) -> _Built:
    """No fp4 MMA on Hopper: the codes times their block scales, multiplied in bf16."""
    import jax.numpy as jnp

    from composer_jax.quant import formats
    from kernels_pallas import hopper_grouped_gemm

    _needs(ops.arch, "hopper")
    lhs_q, rhs_q, want, tensor_scales = _block_scaled(ops, "nvfp4")
    lhs_cs, rhs_cs = (
        formats.dequantize_nvfp4_unscaled(q).astype(jnp.bfloat16) for q in (lhs_q, rhs_q)
    )
    fn = functools.partial(
        hopper_grouped_gemm.grouped_gemm, out_dtype=jnp.bfloat16, interpret=ops.dry_run
    )
    return _Built(fn, (lhs_cs, rhs_cs, ops.sizes, *tensor_scales), want, "bf16")


@_registers(
    *(f"blackwell_{fmt}{variant}" for fmt in ("mxfp8", "nvfp4") for variant in ("", "_persistent", "_2cta"))
)  # fmt: skip
def _blackwell(ops: _Operands, name: str) -> _Built:
    """The tcgen05 kernel: one CTA per tile, or persistent with 1-CTA or CTA-pair MMAs."""
    import jax.numpy as jnp

    from kernels_pallas import blackwell_grouped_gemm, blackwell_persistent

    _needs(ops.arch, "blackwell")
    _, fmt, *variant = name.split("_")
    lhs_q, rhs_q, want, tensor_scales = _block_scaled(ops, fmt)
    if not variant:
        fn = functools.partial(blackwell_grouped_gemm.grouped_gemm, out_dtype=jnp.bfloat16)
    else:
        fn = functools.partial(
            blackwell_persistent.grouped_gemm,
            out_dtype=jnp.bfloat16,
            collective=variant == ["2cta"],
            num_sms=ops.num_sms,
        )
    args = (*_kernel_codes(lhs_q, rhs_q), ops.sizes, *tensor_scales)
    return _Built(fn, args, want, "fp8" if fmt == "mxfp8" else "fp4", ops.lower_or_run())


@_registers("xla_wgrad_bf16", "hopper_wgrad")
def _wgrad_bf16(ops: _Operands, name: str) -> _Built:
    """The experts' weight gradient: XLA's reference or the Hopper kernel."""
    from kernels_pallas import hopper_wgrad

    want = hopper_wgrad.grouped_wgrad_reference(ops.lhs, ops.grad, ops.sizes)
    if name == "xla_wgrad_bf16":
        fn = hopper_wgrad.grouped_wgrad_reference
    else:
        _needs(ops.arch, "hopper")
        fn = functools.partial(hopper_wgrad.grouped_wgrad, interpret=ops.dry_run)
    return _Built(fn, (ops.lhs, ops.grad, ops.sizes), want, "bf16")


@_registers("blackwell_wgrad_mxfp8")
def _blackwell_wgrad(ops: _Operands, name: str) -> _Built:
    """Both operands MXFP8 along the tokens, each expert's rows aligned to 128."""
    from composer_jax.quant import formats
    from kernels_pallas import blackwell_wgrad, grouped_layout

    _needs(ops.arch, "blackwell")
    dest, aligned, padded = grouped_layout.aligned_destinations(
        ops.sizes, ops.lhs.shape[0], blackwell_wgrad.TOKEN_STEP
    )
    lhs_q, grad_q = (
        formats.quantize_mxfp8(grouped_layout.to_aligned_rows(x, dest, padded), axis=0)
        for x in (ops.lhs, ops.grad)
    )
    args = (lhs_q.values, lhs_q.scales, grad_q.values, grad_q.scales, aligned)
    want = blackwell_wgrad.aligned_wgrad_reference(*args)
    return _Built(blackwell_wgrad.aligned_grouped_wgrad, args, want, "fp8", ops.lower_or_run())


@_registers("moe_op_nvfp4_hopper", "moe_op_nvfp4_blackwell")
def _moe_op(ops: _Operands, name: str) -> _Built:
    """The model's quantized expert GEMM end to end: quantization plus the kernel."""
    from composer_jax.quant import moe_gemm

    kernel_arch = name.rsplit("_", 1)[1]
    _needs(ops.arch, kernel_arch)
    recipe, backend = "nvfp4_fwd_mxfp8_bwd", f"pallas_{kernel_arch}"
    want = moe_gemm.quantized_expert_gemm(ops.lhs, ops.rhs, ops.sizes, recipe, "reference")

    def fn(a, b, s):  # the op itself, past the platform check (lowering on CPU)
        return moe_gemm._quantized_gemm(a, b, s, recipe, backend)

    is_blackwell = kernel_arch == "blackwell"
    how = "lower" if ops.dry_run and is_blackwell else "run"
    return _Built(fn, (ops.lhs, ops.rhs, ops.sizes), want, "fp4" if is_blackwell else "bf16", how)


def _rel_err(out, want, valid_rows: int) -> float:
    out = np.asarray(out, np.float32)
    want = np.asarray(want, np.float32)
    scale = max(float(np.abs(want).max()), 1e-30)
    return float(np.abs(out[:valid_rows] - want[:valid_rows]).max() / scale)


def _quantize_case(name: str, lhs, device) -> dict:
    """Quantizing the activations alone: GB/s against the HBM bandwidth."""
    import jax

    from composer_jax.quant import formats

    fmt = name.split("_")[1]
    quantize = formats.quantize_mxfp8 if fmt == "mxfp8" else formats.quantize_nvfp4
    fn = jax.jit(functools.partial(quantize, axis=1))
    q = fn(lhs)
    back = formats.dequantize(q)
    err = _rel_err(back, lhs, lhs.shape[0])
    tol = 0.07 if fmt == "mxfp8" else 0.2  # one E4M3 / E2M1 rounding step of the block max
    if not err <= tol:
        return {"status": "fail", "check": {"max_rel_err": err, "tol": tol}}
    t = timing.device_time_ms(fn, (lhs,))
    out_bits = 8 + 8 / 32 if fmt == "mxfp8" else 4 + 8 / 16
    moved = lhs.size * (2 + out_bits / 8)
    gbps = moved / (t["ms"] * 1e-3) / 1e9
    result = {"status": "ok", "mode": "timed", "check": {"max_rel_err": err, "tol": tol}, **t}
    result["gb_per_s"] = gbps
    if device is not None:
        result["hbm_fraction"] = gbps * 1e9 / device.hbm_bytes_per_s
    return result


def run(params: dict, ctx: dict) -> dict:
    """Case entry point: params {"shape": {...}, "backend": name, "iterations": n}."""
    import jax

    shape, name = params["shape"], params["backend"]
    dry_run = ctx["dry_run"]
    device = devices.spec_for(ctx["device_kind"])
    arch = _arch(device.name if device else None, dry_run)
    lhs, rhs, grad, sizes = _inputs(
        shape["k"], shape["n"], shape["experts"], shape["per_expert"], shape["routing"]
    )
    if name.startswith("quantize_"):
        return _quantize_case(name, lhs, device)
    num_sms = 4 if dry_run or device is None else device.num_sms  # dry run: tiles per CTA > 1
    if name not in _BUILDERS:
        raise ValueError(f"unknown GEMM backend {name!r}; known: {BACKENDS}")
    try:
        built = _BUILDERS[name](_Operands(lhs, rhs, grad, sizes, arch, dry_run, num_sms))
    except NotAvailable as why:
        return {"status": "n/a", "reason": str(why)}
    fn, args, want, fmt = built.fn, built.args, built.want, built.mma_format
    flops = 2.0 * int(sizes.sum()) * shape["k"] * shape["n"]
    if built.how == "lower":  # CPU dry run of a kernel that cannot be interpreted
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        return {"status": "ok", "mode": "lowered for cuda (not run)", "flops": flops}
    compiled = jax.jit(fn).trace(*args).lower().compile()  # once: checked, timed, measured
    out = compiled(*args)
    valid = int(sizes.sum())
    err = _rel_err(out, want, valid)
    tol = 1e-2 if np.dtype(out.dtype).itemsize < 4 else 1e-3
    check = {"max_rel_err": err, "tol": tol}
    is_wgrad = "wgrad" in name
    if not is_wgrad and not name.startswith("jax_"):  # JAX's kernels leave the tail unwritten
        check["tail_zero"] = bool((np.asarray(out, np.float32)[valid:] == 0).all())
    if not (err <= tol and check.get("tail_zero", True)):
        return {"status": "fail", "check": check, "flops": flops}
    t = timing.device_time_ms(compiled, args, params.get("iterations", 10))
    tflops = flops / (t["ms"] * 1e-3) / 1e12
    peak = device.peak(fmt) if device else None
    return {
        "status": "ok",
        "mode": "timed" + (" (interpret mode: not a speed)" if dry_run else ""),
        "check": check,
        "flops": flops,
        "format": fmt,
        "tflops": tflops,
        "peak_fraction": tflops * 1e12 / peak if peak else None,
        "compiled_bytes": timing.compiled_bytes(compiled),
        **t,
    }


def cases(dry_run: bool) -> list[dict]:
    """The GEMM part of the plan: every backend on every shape, one process per shape."""
    out = []
    for shape in DRY_SHAPES if dry_run else SHAPES:
        for backend in BACKENDS:
            out.append(
                dict(
                    name=f"gemm/{shape['name']}/{backend}",
                    kind="gemm",
                    group=f"gemm/{shape['name']}",
                    timeout_s=60 if dry_run else 45,
                    params={"shape": shape, "backend": backend, "iterations": 3 if dry_run else 10},
                )
            )
    return out
