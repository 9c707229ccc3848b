"""MXFP8 / NVFP4 formats: the notes' test vectors and edge cases, and numpy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from composer_jax.quant import formats as F


def _f32(bits: int) -> np.float32:
    return np.frombuffer(np.uint32(bits).tobytes(), np.float32)[0]


def _mx_single(value, mode="rceil"):
    """(scale byte, element code byte, decoded value) of `value` alone in a block."""
    x = jnp.zeros((32,), jnp.float32).at[0].set(value)
    q = F.quantize_mxfp8(x, scale_mode=mode)
    code = jax.lax.bitcast_convert_type(q.values, jnp.uint8)[0]
    return int(q.scales[0]), int(code), float(F.dequantize(q)[0])


@pytest.mark.parametrize(
    "value, rceil, floor",
    [
        (0.0, (0x00, 0x00), (0x00, 0x00)),
        (448.0, (127, 0x7E), (127, 0x7E)),
        (-448.0, (127, 0xFE), (127, 0xFE)),
        (480.0, (128, 0x77), (127, 0x7E)),
        (_f32(0x43FFFFFF), (128, 0x78), (127, 0x7E)),
        (2.0**-126, (0, 0x40), (0, 0x40)),
    ],
)
def test_mxfp8_notes_vectors(value, rceil, floor):
    assert _mx_single(value, "rceil")[:2] == rceil
    assert _mx_single(value, "floor")[:2] == floor


def test_mxfp8_rceil_never_saturates_floor_does():
    assert _mx_single(480.0, "rceil")[2] == 480.0
    assert _mx_single(480.0, "floor")[2] == 448.0  # amax mantissa 1.875 > 1.75: clipped
    assert _mx_single(_f32(0x43FFFFFF), "rceil")[2] == 512.0


def test_e8m0_boundaries():
    amax = jnp.array([448.0, np.nextafter(np.float32(448), np.float32(1e9)), 896.0, 3e38, 1e-38])
    exponent = F.e8m0_exponent(amax)
    np.testing.assert_array_equal(exponent, [0, 1, 1, 120, -127])  # clamps at byte 0
    np.testing.assert_array_equal(
        F.e8m0_exponent(jnp.array([1.0, 511.9, 1e-45]), "floor"), [-8, 0, -127]
    )
    with pytest.raises(ValueError, match="scale_mode"):
        F.e8m0_exponent(amax, "nearest")


def test_rceil_exponent_is_the_exact_ceiling_down_to_the_smallest_scale():
    """ceil(log2(amax / 448)) in float64, clamped to E8M0's range, on fresh magnitudes from
    1e-38 to 1e30, the block maxima whose amax / 448 is subnormal (2.6e-36 to 5.3e-36:
    RCEIL's first scale above the smallest) included."""
    rng = np.random.default_rng()
    tiny = np.float32(2.0**-126) * rng.uniform(0, 600, 5000)
    wide = np.abs(rng.standard_normal(20000)) * 10.0 ** rng.uniform(-38, 30, 20000)
    amax = np.concatenate([tiny, wide]).astype(np.float32)
    got = np.asarray(F.e8m0_exponent(jnp.asarray(amax)))
    with np.errstate(divide="ignore"):
        want = np.clip(np.ceil(np.log2(amax.astype(np.float64) / 448.0)), -127, 127)
    np.testing.assert_array_equal(got, want)


def test_a_row_of_tiny_values_keeps_its_values_in_nvfp4():
    """A row whose largest value is below 2688 x the smallest normal float (3.2e-35): its
    row scale would be flushed to zero (the row decoding to 0) and its inverse overflow."""
    rng = np.random.default_rng()
    for amax in (3e-35, 5e-36, 1e-37):
        x = rng.uniform(-1, 1, (1, 64)).astype(np.float32)
        x = jnp.asarray(x / np.abs(x).max() * np.float32(amax))
        out = np.asarray(F.dequantize(F.quantize_nvfp4(x)))
        assert np.isfinite(out).all()
        assert np.abs(out - np.asarray(x)).max() <= 0.25 * amax


def test_mxfp8_465_trap_is_clipped_not_nan():
    # A block whose max is 448 with FLOOR scale 1: a plain cast of 465 would give NaN.
    assert bool(jnp.isnan(jnp.float32(465.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)))
    x = jnp.zeros((32,), jnp.float32).at[0].set(465.0).at[1].set(-465.0)
    out = F.dequantize(F.quantize_mxfp8(x, scale_mode="floor"))
    np.testing.assert_array_equal(out[:2], [448.0, -448.0])


def test_mxfp8_zero_and_nan_blocks():
    x = jnp.zeros((3, 64), jnp.float32).at[1, 5].set(jnp.nan).at[2, 40].set(jnp.inf)
    x = x.at[2, 1].set(3.0)
    q = F.quantize_mxfp8(x)
    np.testing.assert_array_equal(q.scales, [[0, 0], [0xFF, 0], [127 - 7, 0xFF]])
    out = F.dequantize(q)
    assert not np.isnan(out[0]).any() and (out[0] == 0).all()
    assert np.isnan(out[1, :32]).all() and (out[1, 32:] == 0).all()
    assert out[2, 1] == 3.0 and np.isnan(out[2, 32:]).all()


def test_e4m3_subnormals_round_once():
    # Block max 448 -> scale 1; small elements land on E4M3 subnormals (step 2^-9).
    small = np.array([2.0**-9, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 2.0**-10, 0.7 * 2.0**-9], np.float32)
    x = np.zeros(32, np.float32)
    x[0], x[1:6] = 448.0, small
    out = np.asarray(F.dequantize(F.quantize_mxfp8(jnp.asarray(x))))
    np.testing.assert_array_equal(out[1:6], np.array([1, 2, 2, 0, 1], np.float32) * 2.0**-9)


def test_float32_subnormal_inputs_decode_finite_and_tiny():
    # XLA:CPU flushes f32 subnormals (these blocks then quantize like zero blocks); other
    # platforms may keep them. Either way: no NaN/Inf and an error below the smallest normal.
    x = jnp.zeros((2, 32), jnp.float32).at[0, 0].set(1e-40).at[0, 1].set(-3e-39)
    x = x.at[1, :16].set(1e-39)
    for q in (F.quantize_mxfp8(x), F.quantize_nvfp4(x)):
        out = np.asarray(F.dequantize(q))
        assert np.isfinite(out).all() and np.abs(out - np.asarray(x)).max() < 2.0**-126


def _mx_reference(x: np.ndarray, mode: str) -> np.ndarray:
    """numpy MXFP8 along the last axis, rounding once (ml_dtypes casts f32 -> e4m3 directly)."""
    blocks = x.reshape(x.shape[:-1] + (-1, 32)).astype(np.float64)
    amax = np.abs(blocks).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        if mode == "rceil":
            e = np.ceil(np.log2(amax / 448.0))
        else:
            e = np.floor(np.log2(amax)) - 8
    e = np.clip(np.where(amax == 0, -127, e), -127, 127)
    scaled = np.clip(blocks * 2.0**-e, -448, 448).astype(np.float32)
    codes = scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (codes * 2.0**e).reshape(x.shape).astype(np.float32)


@pytest.mark.parametrize("mode", F.SCALE_MODES)
def test_mxfp8_matches_numpy_reference_and_jit(mode):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 128)) * np.exp(rng.uniform(-8, 8, (16, 1)))).astype(np.float32)
    expected = _mx_reference(x, mode)
    fn = jax.jit(lambda v: F.dequantize(F.quantize_mxfp8(v, scale_mode=mode)))
    np.testing.assert_array_equal(fn(jnp.asarray(x)), expected)
    assert not np.array_equal(expected, x)  # the round trip really rounded under jit
    eager = F.dequantize(F.quantize_mxfp8(jnp.asarray(x.T), axis=0, scale_mode=mode))
    np.testing.assert_array_equal(eager, expected.T)


def test_nvfp4_e2m1_ties_to_even_and_saturation():
    # Row and block amax 6: S_enc = 448, block scale exactly 448, element factor 1.
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25, 6.0, 0.5, 3.0, -1.5, 0, 0, 0]
    q = F.quantize_nvfp4(jnp.asarray(vals, jnp.float32))
    expected = [0, 1, 1, 2, 2, 4, 4, -4, 0, 6, 0.5, 3, -1.5, 0, 0, 0]
    np.testing.assert_array_equal(q.values.astype(jnp.float32), expected)
    assert int(q.scales[0]) == 0x7E and float(q.row_scales[0]) == np.float32(6.0 / 2688)
    # Elements above 6 after scaling (block scale rounded down) saturate to 6.
    assert float(F.round_to_grid(jnp.float32(7.0), (1, 0))) == 8.0  # the grid itself: no clip
    x = jnp.zeros(16).at[0].set(6.0 * 449 / 448)
    np.testing.assert_array_equal(F.quantize_nvfp4(x).values.astype(jnp.float32)[0], 6.0)


def _nvfp4_reference(x: np.ndarray) -> np.ndarray:
    """numpy NVFP4 with per-row scale along the last axis (float32 arithmetic, IEEE division)."""
    x = x.astype(np.float32)
    blocks = x.reshape(x.shape[:-1] + (-1, 16))
    return _nvfp4_blocks_reference(blocks, np.abs(x).max(-1)[..., None, None]).reshape(x.shape)


def _nvfp4_2d_reference(w: np.ndarray) -> np.ndarray:
    """numpy NVFP4 of 16x16 tiles of the last two axes with one outer scale per matrix."""
    w = w.astype(np.float32)
    *lead, rows, cols = w.shape
    tiles = w.reshape(*lead, rows // 16, 16, cols // 16, 16).swapaxes(-3, -2)
    tiles = tiles.reshape(*lead, rows // 16, cols // 16, 256)
    matrix_amax = np.abs(w).max((-2, -1))[..., None, None, None]
    out = _nvfp4_blocks_reference(tiles, matrix_amax).reshape(*lead, rows // 16, cols // 16, 16, 16)
    return out.swapaxes(-3, -2).reshape(w.shape)


def _nvfp4_blocks_reference(blocks: np.ndarray, row_amax: np.ndarray) -> np.ndarray:
    """Decoded values of `blocks` [..., block] under the outer scale of `row_amax`."""
    encode = np.where(row_amax == 0, 1, np.float32(2688) / np.where(row_amax == 0, 1, row_amax))
    block_amax = np.abs(blocks).max(-1, keepdims=True)
    s = np.minimum(block_amax * encode / np.float32(6), np.float32(448)).astype(np.float32)
    s = s.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    factor = np.where(s > 0, encode / np.where(s > 0, s, 1), 0).astype(np.float32)
    scaled = np.clip(blocks * factor, -6, 6).astype(np.float32)
    codes = scaled.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    decode = np.where(row_amax == 0, 1, row_amax / np.float32(2688)).astype(np.float32)
    return codes * s * decode


def test_nvfp4_matches_numpy_reference_under_jit():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 64)) * np.exp(rng.uniform(-4, 4, (8, 4)).repeat(16, 1))
    x = x.astype(np.float32)
    x[3] = 0.0
    out = jax.jit(lambda v: F.dequantize(F.quantize_nvfp4(v)))(jnp.asarray(x))
    np.testing.assert_allclose(out, _nvfp4_reference(x), rtol=1e-6, atol=0)
    assert (np.asarray(out)[3] == 0).all()
    rel = np.linalg.norm(out - x) / np.linalg.norm(x)
    assert 0.02 < rel < 0.15


def test_nvfp4_per_token_independence():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((6, 32)), jnp.float32)
    base = F.quantize_nvfp4(x)
    for j, factor in [(0, 1e4), (5, 1e-6), (2, 0.0)]:
        changed = F.quantize_nvfp4(x.at[j].multiply(factor).at[j, 3].set(123.0))
        keep = np.arange(6) != j
        for field in ("values", "scales", "row_scales"):
            a = np.asarray(getattr(base, field).astype(jnp.float32))[keep]
            b = np.asarray(getattr(changed, field).astype(jnp.float32))[keep]
            np.testing.assert_array_equal(a, b)


def test_nvfp4_axis_and_2d_blocks():
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((2, 32, 48)), jnp.float32)
    along_k = F.quantize_nvfp4(w, axis=1)
    assert along_k.scales.shape == (2, 2, 48) and along_k.row_scales.shape == (2, 1, 48)
    np.testing.assert_array_equal(
        F.dequantize(along_k),
        jnp.swapaxes(F.dequantize(F.quantize_nvfp4(jnp.swapaxes(w, 1, 2))), 1, 2),
    )
    tile = F.quantize_nvfp4(w, block_2d=True)
    tile_t = F.quantize_nvfp4(jnp.swapaxes(w, 1, 2), block_2d=True)
    assert tile.scales.shape == (2, 2, 3) and tile.row_scales.shape == (2, 1, 1)
    np.testing.assert_array_equal(F.dequantize(tile), jnp.swapaxes(F.dequantize(tile_t), 1, 2))
    # Against numpy, with magnitudes spread over tiles so each tile's scale matters.
    spread = np.exp(np.random.default_rng().uniform(-3, 3, (2, 2, 1, 3, 1)))
    w_spread = (np.asarray(w).reshape(2, 2, 16, 3, 16) * spread).reshape(w.shape)
    got = F.dequantize(F.quantize_nvfp4(jnp.asarray(w_spread), block_2d=True))
    np.testing.assert_allclose(got, _nvfp4_2d_reference(w_spread), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="multiple"):
        F.quantize_nvfp4(jnp.ones((4, 24)))


def test_nvfp4_stochastic_rounding_is_unbiased():
    # Each column's value between two neighbours of the E2M1 grid (block scale 1: the block's
    # largest magnitude is 6) rounds up with probability (value - lower) / (upper - lower):
    # off the midpoint, and where the grid's step is 0.5, 1 and 2, so a fair coin or noise in
    # value units instead of grid steps shows.
    cases = {
        2.5: (2.0, 3.0),
        2.25: (2.0, 3.0),
        0.6: (0.5, 1.0),
        4.5: (4.0, 6.0),
        -2.75: (-3.0, -2.0),
    }
    x = jnp.full((4096, 16), 6.0)
    for column, value in enumerate(cases, start=1):
        x = x.at[:, column].set(value)
    key = jax.random.key(int(np.random.default_rng().integers(1 << 31)))
    values = np.asarray(F.quantize_nvfp4(x, stochastic_key=key).values.astype(jnp.float32))
    for column, (value, (lower, upper)) in enumerate(cases.items(), start=1):
        got = values[:, column]
        assert set(np.unique(got)) == {lower, upper}, value
        p_up = (value - lower) / (upper - lower)
        assert abs((got == upper).mean() - p_up) < 0.035, value  # 4.5 standard errors or more
        assert abs(got.mean() - value) < 0.035 * (upper - lower), value
    nearest = F.quantize_nvfp4(x).values.astype(jnp.float32)[:, 1]
    assert (np.asarray(nearest) == 2.0).all()  # round to nearest even at the midpoint


def test_fp4_pack_roundtrip():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((3, 32)) * 3, jnp.float32)
    values = F.quantize_nvfp4(x).values
    packed = F.pack_fp4(values)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 16)
    np.testing.assert_array_equal(
        F.unpack_fp4(packed).astype(jnp.float32), values.astype(jnp.float32)
    )
    one = F.pack_fp4(jnp.asarray([0.5, -6.0], jnp.float4_e2m1fn))
    assert int(one[0]) == 0x1 | (0xF << 4)


def test_nvfp4_storage_packed_codes_and_swizzled_scales():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((128, 64)), jnp.float32)
    q = F.quantize_nvfp4(x)
    tiles = F.swizzle_scales(q.scales)  # [128, 4] E4M3 bytes -> one (1, 1, 32, 16) tile
    assert tiles.shape == (1, 1, 32, 16) and tiles.dtype == jnp.uint8
    assert tiles[0, 0, 7, 4 * 2 + 1] == q.scales[2 * 32 + 7, 1]
    np.testing.assert_array_equal(F.unswizzle_scales(tiles), q.scales)
    assert F.pack_fp4(q.values).nbytes == 128 * 64 // 2
