"""MXFP8 and per-token NVFP4 block formats: exact quantize / dequantize in plain JAX.

Every rounding step is done with integer bit arithmetic and `jnp.round` on exactly scaled values,
so results never depend on XLA's convert path (XLA:CPU rounds f32 -> fp8 / fp4 through f16, i.e.
twice) and a jitted f32 -> fp8 -> f32 round trip that XLA elides still gives the rounded value.
Values are kept in their original layout; block scales are raw uint8 bit patterns with the
blocked axis divided by the block size.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

# The Blackwell tensor cores' block-scale tile layout, for storage next to packed codes.
from kernels_pallas.grouped_layout import swizzle_scales as swizzle_scales
from kernels_pallas.grouped_layout import unswizzle_scales as unswizzle_scales

MX_BLOCK = 32
NVFP4_BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E8M0_NAN = 0xFF
SCALE_MODES = ("rceil", "floor")
# (mantissa bits, exponent of the smallest normal) of the element formats.
_E4M3 = (3, -6)
_E2M1 = (1, 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP8Tensor:
    """E4M3 values plus one E8M0 scale byte per 32 values along `axis`."""

    values: jax.Array  # float8_e4m3fn, same shape as the source
    scales: jax.Array  # uint8 E8M0 bytes, source shape with `axis` divided by 32
    axis: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    """E2M1 values, E4M3 block-scale bytes, and an FP32 decode scale per vector (token).

    `block` is the block shape over the last `len(block)` blocked axes: (16,) along `axis`, or
    (16, 16) over the last two axes for 2D weight scaling.
    """

    values: jax.Array  # float4_e2m1fn, same shape as the source
    scales: jax.Array  # uint8 E4M3 bytes, source shape with blocked axes divided by the block
    row_scales: jax.Array  # float32 decode scale amax / (6 * 448), blocked axes kept as size 1
    axis: int = dataclasses.field(metadata=dict(static=True))
    block: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))


def _pow2(exponent: jax.Array) -> jax.Array:
    """Exact float32 2**exponent for integer exponent in [-126, 127], built from bits."""
    bits = (exponent.astype(jnp.int32) + 127) << 23
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _scale_by_pow2(x: jax.Array, exponent: jax.Array) -> jax.Array:
    """x * 2**exponent for exponent in [-254, 254] in two normal steps (no subnormal factor)."""
    exponent = exponent.astype(jnp.int32)
    half = exponent // 2
    return x * _pow2(half) * _pow2(exponent - half)


def _biased_exponent(x: jax.Array) -> jax.Array:
    """The 8-bit exponent field of float32 x (0 for zero and subnormals)."""
    return (jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) >> 23) & 0xFF


def round_to_grid(x: jax.Array, fmt: tuple[int, int], noise: jax.Array | None = None) -> jax.Array:
    """Round float32 x to a minifloat grid (mantissa bits, min normal exponent), once.

    Round to nearest even, or stochastic with `noise` uniform in [0, 1). No saturation: callers
    clip first. The result is exactly representable in the target format and in float32.
    """
    mantissa_bits, min_exponent = fmt
    magnitude = jnp.abs(x)
    exponent = jnp.maximum(_biased_exponent(magnitude) - 127, min_exponent)
    scaled = _scale_by_pow2(magnitude, mantissa_bits - exponent)  # exact: power-of-two factor
    steps = jnp.round(scaled) if noise is None else jnp.floor(scaled + noise)
    return jnp.sign(x) * _scale_by_pow2(steps, exponent - mantissa_bits)


def _blocked(x: jax.Array, axis: int, block: int) -> jax.Array:
    """Move `axis` last and split it into (n_blocks, block)."""
    x = jnp.moveaxis(x, axis, -1)
    if x.shape[-1] % block:
        raise ValueError(f"axis of size {x.shape[-1]} is not a multiple of the block {block}")
    return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def _unblocked(x: jax.Array, axis: int) -> jax.Array:
    return jnp.moveaxis(x.reshape(x.shape[:-2] + (-1,)), -1, axis)


def e8m0_exponent(amax: jax.Array, scale_mode: str = "rceil") -> jax.Array:
    """Unbiased E8M0 scale exponent for blocks with absolute maximum `amax` (finite)."""
    if scale_mode == "rceil":
        # ceil(log2(amax / 448)) from the bits of d = amax * (1/448): d's exponent, plus one if any
        # mantissa bit is set. A subnormal (or flushed) d is below 2^-126: ceil(log2 d) is -126
        # when d > 2^-127 (told from amax itself, which is normal there), else the smallest.
        amax = amax.astype(jnp.float32)
        bits = jax.lax.bitcast_convert_type(amax * np.float32(1.0 / E4M3_MAX), jnp.int32)
        field = (bits >> 23) & 0xFF
        biased = field + ((bits & 0x7FFFFF) != 0)
        above = (amax > np.float32(E4M3_MAX * 2.0**-127)).astype(jnp.int32)
        biased = jnp.where(field == 0, above, biased)
    elif scale_mode == "floor":
        # OCP: floor(log2(amax)) - 8 (8 = exponent of E4M3's largest power of two).
        biased = _biased_exponent(amax) - 8
    else:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    return jnp.clip(biased, 0, 254) - 127


@functools.partial(jax.jit, static_argnames=("axis", "scale_mode"))
def quantize_mxfp8(x: jax.Array, *, axis: int = -1, scale_mode: str = "rceil") -> MXFP8Tensor:
    """MXFP8: E4M3 values with an E8M0 scale per 32 contiguous values along `axis`.

    Scaled values are clipped to +-448 before rounding (an unclipped cast would turn 465 into
    NaN). A block holding a NaN or Inf gets scale 0xFF and decodes to NaN; an all-zero block gets
    scale byte 0 and zero codes.
    """
    axis = axis % x.ndim
    blocks = _blocked(x.astype(jnp.float32), axis, MX_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    finite = jnp.isfinite(amax)
    exponent = e8m0_exponent(jnp.where(finite, amax, 0.0), scale_mode)
    scaled = jnp.clip(_scale_by_pow2(blocks, -exponent), -E4M3_MAX, E4M3_MAX)
    codes = jnp.where(finite, round_to_grid(scaled, _E4M3), 0.0)
    scale_bytes = jnp.where(finite, exponent + 127, E8M0_NAN).astype(jnp.uint8)
    return MXFP8Tensor(
        values=_unblocked(codes, axis).astype(jnp.float8_e4m3fn),
        scales=jnp.moveaxis(scale_bytes[..., 0], -1, axis),
        axis=axis,
    )


def e4m3_from_bytes(scale_bytes: jax.Array) -> jax.Array:
    """float32 values of E4M3 bit patterns (uint8)."""
    return jax.lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn).astype(jnp.float32)


def e4m3_to_bytes(x: jax.Array) -> jax.Array:
    """uint8 bit patterns of float32 values that are exactly representable in E4M3."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.float8_e4m3fn), jnp.uint8)


_SMALLEST_ROW_AMAX = np.float32(E2M1_MAX * E4M3_MAX * 2.0**-126)


@functools.partial(jax.jit, static_argnames=("axis", "block_2d"))
def quantize_nvfp4(
    x: jax.Array,
    *,
    axis: int = -1,
    stochastic_key: jax.Array | None = None,
    block_2d: bool = False,
) -> NVFP4Tensor:
    """NVFP4 with a per-token FP32 scale: E2M1 values, E4M3 scale per 16 values along `axis`.

    The outer scale S_enc = 6 * 448 / amax is taken per vector along `axis` (per token for
    activations), so one token's codes never depend on another's. With `block_2d` the blocks are
    16x16 tiles of the last two axes and the outer scale is per matrix, so W and W^T quantize
    identically. `stochastic_key` turns on stochastic rounding of the elements (for gradients).
    Division is IEEE-exact. A block whose scale underflows E4M3 decodes to zeros.
    """
    axis = axis % x.ndim
    x = x.astype(jnp.float32)
    if block_2d:
        if x.ndim < 2 or axis < x.ndim - 2:
            raise ValueError("block_2d needs the blocked axis among the last two of a matrix")
        rows, cols = x.shape[-2:]
        if rows % NVFP4_BLOCK or cols % NVFP4_BLOCK:
            raise ValueError(f"block_2d needs both matrix dims multiples of 16, got {x.shape}")
        tiles = x.reshape(x.shape[:-2] + (rows // 16, 16, cols // 16, 16))
        tiles = jnp.swapaxes(tiles, -3, -2)  # [..., R/16, C/16, 16, 16]
        tiles = tiles.reshape(tiles.shape[:-2] + (256,))
        vector_axes = (-3, -2, -1)
    else:
        tiles = _blocked(x, axis, NVFP4_BLOCK)
        vector_axes = (-2, -1)
    magnitude = jnp.abs(tiles)
    row_amax = jnp.max(magnitude, axis=vector_axes, keepdims=True)
    # A row scale (row_amax / 2688) below the smallest normal float would be flushed to zero
    # (a row decoding to 0) and its inverse overflow: tiny rows use that smallest scale.
    row_amax = jnp.where(row_amax == 0, 0.0, jnp.maximum(row_amax, _SMALLEST_ROW_AMAX))
    encode = jnp.where(row_amax == 0, 1.0, (E2M1_MAX * E4M3_MAX) / row_amax)
    block_amax = jnp.max(magnitude, axis=-1, keepdims=True)
    block_scale = jnp.minimum(block_amax * encode / E2M1_MAX, E4M3_MAX)
    block_scale = round_to_grid(block_scale, _E4M3)
    nonzero = block_scale > 0
    element_factor = jnp.where(nonzero, encode / jnp.where(nonzero, block_scale, 1.0), 0.0)
    noise = None
    if stochastic_key is not None:
        noise = jax.random.uniform(stochastic_key, tiles.shape, jnp.float32)
    scaled = jnp.clip(tiles * element_factor, -E2M1_MAX, E2M1_MAX)
    codes = jnp.minimum(round_to_grid(scaled, _E2M1, noise), E2M1_MAX)
    decode = jnp.where(row_amax == 0, 1.0, row_amax / (E2M1_MAX * E4M3_MAX))
    if block_2d:
        codes = jnp.swapaxes(codes.reshape(codes.shape[:-1] + (16, 16)), -3, -2)
        values = codes.reshape(x.shape)
        scales, row_scales, block = block_scale[..., 0], decode[..., 0], (16, 16)
    else:
        values = _unblocked(codes, axis)
        scales = jnp.moveaxis(block_scale[..., 0], -1, axis)
        row_scales = jnp.moveaxis(decode[..., 0], -1, axis)
        block = (NVFP4_BLOCK,)
    return NVFP4Tensor(
        values=values.astype(jnp.float4_e2m1fn),
        scales=e4m3_to_bytes(scales),
        row_scales=row_scales,
        axis=axis,
        block=block,
    )


def _expand(scales: jax.Array, axes: tuple[int, ...], block: tuple[int, ...]) -> jax.Array:
    for ax, size in zip(axes, block):
        scales = jnp.repeat(scales, size, axis=ax)
    return scales


@jax.jit
def dequantize(q: MXFP8Tensor | NVFP4Tensor) -> jax.Array:
    """float32 values of a quantized tensor."""
    if isinstance(q, MXFP8Tensor):
        exponent = _expand(q.scales.astype(jnp.int32) - 127, (q.axis,), (MX_BLOCK,))
        out = _scale_by_pow2(q.values.astype(jnp.float32), exponent)
        is_nan = _expand(q.scales == E8M0_NAN, (q.axis,), (MX_BLOCK,))
        return jnp.where(is_nan, jnp.nan, out)
    return dequantize_nvfp4_unscaled(q) * q.row_scales


def dequantize_nvfp4_unscaled(q: NVFP4Tensor) -> jax.Array:
    """Codes times block scales, without the per-token factor (applied in a GEMM epilogue).

    Exact in bfloat16: an E2M1 code times an E4M3 scale has at most 5 significant bits.
    """
    axes = (q.values.ndim - 2, q.values.ndim - 1) if len(q.block) == 2 else (q.axis,)
    block_scales = _expand(e4m3_from_bytes(q.scales), axes, q.block)
    return q.values.astype(jnp.float32) * block_scales


_E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


@jax.jit
def pack_fp4(values: jax.Array) -> jax.Array:
    """Two E2M1 codes per byte along the last axis (element 2i in the low nibble)."""
    if values.shape[-1] % 2:
        raise ValueError(f"last axis must be even to pack fp4, got {values.shape}")
    v = values.astype(jnp.float32)
    magnitude_code = jnp.searchsorted(jnp.asarray(_E2M1_MAGNITUDES), jnp.abs(v))
    codes = (magnitude_code | (jnp.signbit(v).astype(jnp.int32) << 3)).astype(jnp.uint8)
    pairs = codes.reshape(codes.shape[:-1] + (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


@jax.jit
def unpack_fp4(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_fp4`: float4_e2m1fn values, last axis doubled."""
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1,))
    magnitude = jnp.asarray(_E2M1_MAGNITUDES)[(codes & 7).astype(jnp.int32)]
    return jnp.where(codes >= 8, -magnitude, magnitude).astype(jnp.float4_e2m1fn)
