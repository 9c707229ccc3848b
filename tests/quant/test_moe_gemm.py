"""The quantized expert GEMM: error bounds vs bf16, exact backward semantics, the tiny model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import presets
from composer_jax.model import init_model
from composer_jax.quant import formats
from composer_jax.quant.moe_gemm import quantized_expert_gemm

# Documented relative Frobenius error bounds vs the exact product, Gaussian operands (measured
# ~3.9e-2 for MXFP8 and ~1.35e-1 for NVFP4 at these shapes; bf16 output rounding included).
REL_BOUND = {"mxfp8": 5e-2, "nvfp4_fwd_mxfp8_bwd": 1.8e-1}
GRAD_REL_BOUND = 5e-2  # the backward pass is MXFP8 for both recipes
M, K, N, E = 100, 64, 48, 4
GROUPS = np.array([30, 0, 40, 20], np.int32)  # an empty expert, and 10 rows past the groups


def _operands(seed, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((M, K)), dtype)
    rhs = jnp.asarray(rng.standard_normal((E, K, N)) / 8, dtype)
    grad = jnp.asarray(rng.standard_normal((M, N)), dtype)
    return lhs, rhs, grad


def _exact(lhs, rhs):
    return jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), jnp.asarray(GROUPS))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _op(precision):
    return jax.jit(lambda x, w: quantized_expert_gemm(x, w, jnp.asarray(GROUPS), precision))


@pytest.mark.parametrize("precision", list(REL_BOUND))
def test_forward_backward_within_documented_bounds(precision):
    lhs, rhs, grad = _operands(0)
    out, vjp = jax.vjp(_op(precision), lhs, rhs)
    want, want_vjp = jax.vjp(_exact, lhs, rhs)
    assert out.dtype == lhs.dtype and out.shape == (M, N)
    valid = int(GROUPS.sum())
    assert (np.asarray(out[valid:], np.float32) == 0).all()
    assert 1e-2 < _rel(out, want) < REL_BOUND[precision]
    dlhs, drhs = vjp(grad)
    want_dlhs, want_drhs = want_vjp(grad.astype(jnp.float32))
    assert dlhs.dtype == lhs.dtype and drhs.dtype == rhs.dtype
    assert (np.asarray(dlhs[valid:], np.float32) == 0).all()
    assert _rel(dlhs[:valid], want_dlhs[:valid]) < GRAD_REL_BOUND
    assert _rel(drhs, want_drhs) < GRAD_REL_BOUND
    assert (np.asarray(drhs[1], np.float32) == 0).all()  # the empty expert


_QUANTIZE = {"mxfp8": formats.quantize_mxfp8, "nvfp4_fwd_mxfp8_bwd": formats.quantize_nvfp4}


@pytest.mark.parametrize("precision", list(REL_BOUND))
def test_forward_is_the_exact_product_of_the_quantized_operands(precision):
    """The forward equals a float64 grouped product of the dequantized operands (each quantized
    along K, with its per-token or per-column factors) up to the bf16 output's rounding: a row
    given another expert's factors or codes shows, where the error bound vs bf16 above would
    not see a few rows."""
    lhs, rhs, _ = _operands(int(np.random.default_rng().integers(1 << 31)))
    out = np.asarray(_op(precision)(lhs, rhs), np.float64)
    quantize = _QUANTIZE[precision]
    lhs_q = np.asarray(formats.dequantize(quantize(lhs.astype(jnp.float32), axis=1)), np.float64)
    rhs_q = np.asarray(formats.dequantize(quantize(rhs.astype(jnp.float32), axis=1)), np.float64)
    want = np.zeros((M, N))
    start = 0
    for expert, size in enumerate(GROUPS):
        want[start : start + size] = lhs_q[start : start + size] @ rhs_q[expert]
        start += size
    scale = np.abs(want).max()
    np.testing.assert_allclose(out, want, rtol=2**-8, atol=1e-4 * scale)


def _mx(x, axis):
    """MXFP8 round trip along `axis`, zero-padded to a whole block (as the op pads)."""
    x = jnp.asarray(x, jnp.float32)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, -x.shape[axis] % 32)
    out = formats.dequantize(formats.quantize_mxfp8(jnp.pad(x, widths), axis=axis))
    return jax.lax.slice_in_dim(out, 0, x.shape[axis], axis=axis)


def _directional_fd(loss, x, direction, eps=1.0):
    """Central difference; exact up to rounding because each loss is linear in x."""
    return (loss(x + eps * direction) - loss(x - eps * direction)) / (2 * eps)


def test_gradients_match_finite_differences_of_dequantized_reference():
    lhs, rhs, grad = _operands(1, jnp.float32)
    groups = jnp.asarray(GROUPS)
    _, vjp = jax.vjp(_op("nvfp4_fwd_mxfp8_bwd"), lhs, rhs)
    dlhs, drhs = vjp(grad)
    rng = np.random.default_rng(5)

    # dgrad: gradient of <Q_N(g), x @ Q_N(w)> in x.
    g_n, w_n = _mx(grad, 1), _mx(rhs, 2)
    loss_x = jax.jit(lambda x: jnp.vdot(g_n, jax.lax.ragged_dot(x, w_n, groups)))
    for _ in range(3):
        v = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
        fd = _directional_fd(loss_x, lhs, v)
        np.testing.assert_allclose(jnp.vdot(dlhs, v), fd, rtol=2e-3)

    # wgrad: per expert, both operands MXFP8 along tokens, each expert's rows padded to 32.
    starts = np.concatenate([[0], np.cumsum(GROUPS)[:-1]])

    def expert_rows(x, e):
        rows = np.asarray(x)[starts[e] : starts[e] + GROUPS[e]]
        return np.pad(rows, ((0, -len(rows) % 32), (0, 0)))

    x_q = [_mx(expert_rows(lhs, e), 0) for e in range(E)]
    g_q = [_mx(expert_rows(grad, e), 0) for e in range(E)]

    @jax.jit
    def loss_w(w):
        return sum(jnp.vdot(g_q[e], x_q[e] @ w[e]) for e in range(E))

    for _ in range(3):
        v = jnp.asarray(rng.standard_normal((E, K, N)), jnp.float32)
        fd = _directional_fd(loss_w, rhs, v)
        np.testing.assert_allclose(jnp.vdot(drhs, v), fd, rtol=2e-3)


def test_errors_name_precision_and_backend():
    lhs, rhs, _ = _operands(2)
    groups = jnp.asarray(GROUPS)
    with pytest.raises(ValueError, match="precision"):
        quantized_expert_gemm(lhs, rhs, groups, precision="int8")
    with pytest.raises(RuntimeError, match="pallas_blackwell.*cpu"):
        quantized_expert_gemm(lhs, rhs, groups, backend="pallas_blackwell")
    with pytest.raises(ValueError, match="expert_backend"):
        quantized_expert_gemm(lhs, rhs, groups, backend="cutlass")


@pytest.fixture(scope="module")
def tiny_batch():
    cfg = presets.tiny().model
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (2, 16))
    return tokens, positions, jnp.ones((2, 16), jnp.int32)


def _loss_and_grads(precision, batch):
    cfg = dataclasses.replace(presets.tiny().model, expert_precision=precision)
    graphdef, params, rest = nnx.split(init_model(cfg), nnx.Param, ...)
    tokens, positions, segments = batch

    @jax.jit
    def loss_fn(params):
        m = nnx.merge(graphdef, params, rest)
        logits = m.logits(m(tokens, positions, segments).hidden_BTD)
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    return jax.value_and_grad(loss_fn)(params)


def test_tiny_model_forward_backward_in_low_precision(tiny_batch):
    base_loss, base_grads = _loss_and_grads("bf16", tiny_batch)
    for precision in ("nvfp4_fwd_mxfp8_bwd",):  # mxfp8 shares every code path but the forward
        loss, grads = _loss_and_grads(precision, tiny_batch)
        assert np.isfinite(loss) and abs(loss - base_loss) / base_loss < 1e-2
        flat, base_flat = jax.tree.leaves(grads), jax.tree.leaves(base_grads)
        assert all(np.isfinite(np.asarray(g)).all() for g in flat)
        total = np.concatenate([np.ravel(g) for g in flat])
        base_total = np.concatenate([np.ravel(g) for g in base_flat])
        assert _rel(total, base_total) < 0.25
