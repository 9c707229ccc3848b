"""The quantized expert grouped GEMM: NVFP4 or MXFP8 forward, MXFP8 backward, as a custom VJP.

Rows of `lhs_MK` are sorted by expert; rows [start_e, start_e + group_sizes[e]) multiply
`rhs_EKN[e]`, and rows past sum(group_sizes) give zeros. Every GEMM accumulates in float32 and the
result is cast back to the operand dtype. Each operand is quantized from the high-precision source
along the axis that GEMM contracts:

  forward  out = lhs @ rhs[e]      lhs per token along K, rhs per (expert, column) along K
  dgrad    dlhs = g @ rhs[e]^T     both MXFP8 along N
  wgrad    drhs[e] = lhs_e^T @ g_e both MXFP8 along the token axis, each expert's rows padded to
                                   a multiple of 32 so no scale block straddles two experts

The NVFP4 per-token (and per-column) FP32 factors are applied after the integer-grid product:
by the kernel's epilogue (with the output cast) on the Pallas backends, as an XLA multiply
on `reference`; the backends multiply codes times block scales, which bf16 holds exactly. The wgrad
runs the Hopper wgrad kernel (bf16 wgmma on codes x scales) on `pallas_hopper`, the Blackwell
MXFP8 wgrad kernel (block-scaled fp8 MMAs on the codes) on `pallas_blackwell`, and XLA's
`ragged_dot_general` on `reference`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from composer_jax.quant import formats
from kernels_pallas import grouped_layout

PRECISIONS = ("mxfp8", "nvfp4_fwd_mxfp8_bwd")
BACKENDS = ("reference", "pallas_hopper", "pallas_blackwell")
# Rows per token step of each wgrad kernel: every expert's rows start on such a boundary.
_WGRAD_ALIGN = {"pallas_hopper": 64, "pallas_blackwell": 128}
# Platforms each kernel backend runs on (None: any); the Hopper kernel is interpreted on CPU.
_BACKEND_PLATFORMS = {
    "reference": None,
    "pallas_hopper": ("gpu", "cuda", "cpu"),
    "pallas_blackwell": ("gpu", "cuda"),
}


def _pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _bf16(x: jax.Array) -> jax.Array:
    """Dequantized codes (times block scales) are exact in bfloat16."""
    return x.astype(jnp.bfloat16)


def _codes_times_scales(q: formats.MXFP8Tensor | formats.NVFP4Tensor) -> jax.Array:
    if isinstance(q, formats.NVFP4Tensor):
        return _bf16(formats.dequantize_nvfp4_unscaled(q))
    return _bf16(formats.dequantize(q))


def _interpret() -> bool:
    """Hopper kernels run under Mosaic GPU interpret mode on CPU (slow, exact)."""
    return jax.default_backend() == "cpu"


def _block_scaled_product(lhs_q, rhs_q, group_sizes_E, backend: str) -> jax.Array:
    """float32 sum over K of codes x block scales; lhs [M, K] and rhs [E, K, N] blocked along K."""
    if backend == "pallas_blackwell":
        from kernels_pallas import blackwell_grouped_gemm

        return blackwell_grouped_gemm.grouped_gemm(
            lhs_q.values,
            lhs_q.scales,
            jnp.swapaxes(rhs_q.values, 1, 2),
            jnp.swapaxes(rhs_q.scales, 1, 2),
            group_sizes_E,
        )
    if backend == "pallas_hopper":
        from kernels_pallas import hopper_grouped_gemm

        interpret = _interpret()
        if isinstance(lhs_q, formats.MXFP8Tensor):  # fp8 wgmma, scales promoted per block
            return hopper_grouped_gemm.mxfp8_grouped_gemm(
                lhs_q.values,
                lhs_q.scales,
                jnp.swapaxes(rhs_q.values, 1, 2),
                jnp.swapaxes(rhs_q.scales, 1, 2),
                group_sizes_E,
                interpret=interpret,
            )
        lhs, rhs = _codes_times_scales(lhs_q), _codes_times_scales(rhs_q)  # no fp4 wgmma
        return hopper_grouped_gemm.grouped_gemm(lhs, rhs, group_sizes_E, interpret=interpret)
    lhs, rhs = _codes_times_scales(lhs_q), _codes_times_scales(rhs_q)
    return grouped_layout.grouped_gemm_reference(lhs, rhs, group_sizes_E)


def _mxfp8_gemm(lhs_MK, rhs_EKN, group_sizes_E, backend: str) -> jax.Array:
    """Both operands MXFP8 along K (zero-padded to a multiple of 32)."""
    lhs_q = formats.quantize_mxfp8(_pad_axis(lhs_MK, 1, formats.MX_BLOCK), axis=1)
    rhs_q = formats.quantize_mxfp8(_pad_axis(rhs_EKN, 1, formats.MX_BLOCK), axis=1)
    return _block_scaled_product(lhs_q, rhs_q, group_sizes_E, backend)


def _nvfp4_gemm(lhs_MK, rhs_EKN, group_sizes_E, backend: str) -> jax.Array:
    """Both operands NVFP4 along K; per-token and per-column FP32 factors in the epilogue."""
    lhs_q = formats.quantize_nvfp4(_pad_axis(lhs_MK, 1, formats.NVFP4_BLOCK), axis=1)
    rhs_q = formats.quantize_nvfp4(_pad_axis(rhs_EKN, 1, formats.NVFP4_BLOCK), axis=1)
    if backend == "pallas_blackwell":  # factors and the output cast in the kernel's epilogue
        from kernels_pallas import blackwell_grouped_gemm

        return blackwell_grouped_gemm.grouped_gemm(
            lhs_q.values,
            lhs_q.scales,
            jnp.swapaxes(rhs_q.values, 1, 2),
            jnp.swapaxes(rhs_q.scales, 1, 2),
            group_sizes_E,
            lhs_q.row_scales[:, 0],
            rhs_q.row_scales[:, 0, :],
            out_dtype=lhs_MK.dtype,
        )
    if backend == "pallas_hopper":
        from kernels_pallas import hopper_grouped_gemm

        return hopper_grouped_gemm.grouped_gemm(
            _codes_times_scales(lhs_q),
            _codes_times_scales(rhs_q),
            group_sizes_E,
            lhs_q.row_scales[:, 0],
            rhs_q.row_scales[:, 0, :],
            out_dtype=lhs_MK.dtype,
            interpret=_interpret(),
        )
    acc = _block_scaled_product(lhs_q, rhs_q, group_sizes_E, backend)
    expert = grouped_layout.expert_of_row(group_sizes_E, acc.shape[0])
    return acc * lhs_q.row_scales * rhs_q.row_scales[expert, 0]


def _mxfp8_wgrad(lhs_MK, grad_MN, group_sizes_E, backend: str) -> jax.Array:
    """drhs[e] = lhs_e^T grad_e with both operands MXFP8 along the token axis, per expert."""
    # Each expert's rows start on a block boundary so no scale block straddles two experts (the
    # Hopper kernel also needs whole 64-row token steps, the Blackwell one 128-row steps; the
    # blocks, hence the codes and scales, are the same whatever the alignment).
    align = _WGRAD_ALIGN.get(backend, formats.MX_BLOCK)
    dest, padded_sizes, padded_rows = grouped_layout.aligned_destinations(
        group_sizes_E, lhs_MK.shape[0], align
    )
    lhs_q = formats.quantize_mxfp8(
        grouped_layout.to_aligned_rows(lhs_MK, dest, padded_rows), axis=0
    )
    grad_q = formats.quantize_mxfp8(
        grouped_layout.to_aligned_rows(grad_MN, dest, padded_rows), axis=0
    )
    if backend == "pallas_blackwell":  # block-scaled fp8 MMAs contracting the tokens
        from kernels_pallas import blackwell_wgrad

        return blackwell_wgrad.aligned_grouped_wgrad(
            lhs_q.values, lhs_q.scales, grad_q.values, grad_q.scales, padded_sizes
        )
    lhs_dq = _bf16(formats.dequantize(lhs_q))
    grad_dq = _bf16(formats.dequantize(grad_q))
    if backend == "pallas_hopper":
        from kernels_pallas import hopper_wgrad

        return hopper_wgrad.aligned_grouped_wgrad(
            lhs_dq, grad_dq, padded_sizes, block_t=align, interpret=_interpret()
        )
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return jax.lax.ragged_dot_general(
        lhs_dq, grad_dq, padded_sizes, numbers, preferred_element_type=jnp.float32
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _quantized_gemm(lhs_MK, rhs_EKN, group_sizes_E, precision: str, backend: str):
    if precision == "mxfp8":
        out = _mxfp8_gemm(lhs_MK, rhs_EKN, group_sizes_E, backend)
    else:
        out = _nvfp4_gemm(lhs_MK, rhs_EKN, group_sizes_E, backend)
    return out.astype(lhs_MK.dtype)


def _quantized_gemm_fwd(lhs_MK, rhs_EKN, group_sizes_E, precision, backend):
    out = _quantized_gemm(lhs_MK, rhs_EKN, group_sizes_E, precision, backend)
    return out, (lhs_MK, rhs_EKN, group_sizes_E)


def _quantized_gemm_bwd(precision, backend, residuals, grad_MN):
    del precision  # the backward pass is MXFP8 for every recipe
    lhs_MK, rhs_EKN, group_sizes_E = residuals
    k, n = lhs_MK.shape[1], grad_MN.shape[1]
    rhs_ENK = jnp.swapaxes(rhs_EKN, 1, 2)
    dlhs = _mxfp8_gemm(grad_MN, rhs_ENK, group_sizes_E, backend)[:, :k]
    drhs = _mxfp8_wgrad(lhs_MK, grad_MN, group_sizes_E, backend)[:, :k, :n]
    return dlhs.astype(lhs_MK.dtype), drhs.astype(rhs_EKN.dtype), None


_quantized_gemm.defvjp(_quantized_gemm_fwd, _quantized_gemm_bwd)


def check_backend(backend: str) -> None:
    """Raise a clear error when `backend` cannot run on the default JAX platform."""
    if backend not in BACKENDS:
        raise ValueError(f"expert_backend must be one of {BACKENDS}, got {backend!r}")
    platforms = _BACKEND_PLATFORMS[backend]
    platform = jax.default_backend()
    if platforms is not None and platform not in platforms:
        raise RuntimeError(
            f"expert_backend={backend!r} cannot run on platform {platform!r}"
            f" (needs one of {platforms}); use 'reference'"
        )


def quantized_expert_gemm(
    lhs_MK: jax.Array,
    rhs_EKN: jax.Array,
    group_sizes_E: jax.Array,
    precision: str = "nvfp4_fwd_mxfp8_bwd",
    backend: str = "reference",
) -> jax.Array:
    """Grouped GEMM of expert-sorted rows in low precision; output in `lhs_MK.dtype`."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    check_backend(backend)
    if lhs_MK.ndim != 2 or rhs_EKN.ndim != 3 or lhs_MK.shape[1] != rhs_EKN.shape[1]:
        raise ValueError(f"expected lhs [M, K], rhs [E, K, N]; got {lhs_MK.shape}, {rhs_EKN.shape}")
    return _quantized_gemm(lhs_MK, rhs_EKN, group_sizes_E.astype(jnp.int32), precision, backend)
