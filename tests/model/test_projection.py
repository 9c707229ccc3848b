"""`project` is the einsum it replaces, forward and backward, on fresh random inputs: in float32
against float64 (to rounding) and in bfloat16 against float32 (to bfloat16's precision); and its
CPU weight gradient is a GEMM XLA:CPU hands to its fast path (no generic `dot` left)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.model.projection import project

# (x shape, w shape, contract, the einsum it stands for): every form the model uses.
CASES = [
    ((2, 5, 8), (8, 6), 1, "btd,dn->btn"),
    ((2, 5, 8), (8, 3, 4), 1, "btd,dhk->bthk"),
    ((2, 5, 3, 4), (3, 4, 8), 2, "bthk,hkd->btd"),
    ((7, 8), (8, 6), 1, "nd,dm->nm"),
]


def _loss(fn, x, w):
    y = fn(x, w)
    cotangent = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(y.astype(jnp.float32) * cotangent)


@pytest.mark.parametrize("x_shape, w_shape, contract, spec", CASES)
def test_project_equals_the_einsum_forward_and_backward(x_shape, w_shape, contract, spec):
    rng = np.random.default_rng(sum(x_shape) + len(spec))
    x64, w64 = rng.normal(size=x_shape), rng.normal(size=w_shape)
    with jax.enable_x64():
        want = jnp.einsum(spec, x64, w64)
        want_grads = jax.grad(lambda x, w: _loss(lambda a, b: jnp.einsum(spec, a, b), x, w),
                              argnums=(0, 1))(x64, w64)  # fmt: skip
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
        x, w = jnp.asarray(x64, dtype), jnp.asarray(w64, dtype)
        got = jax.jit(project, static_argnums=2)(x, w, contract)
        grads = jax.jit(jax.grad(lambda x, w: _loss(lambda a, b: project(a, b, contract), x, w),
                                 argnums=(0, 1)))(x, w)  # fmt: skip
        assert got.dtype == dtype and grads[0].dtype == dtype and grads[1].dtype == dtype
        scale = np.abs(np.asarray(want)).max()
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol * scale)
        for g, g_want in zip(grads, want_grads):
            scale = np.abs(np.asarray(g_want)).max()
            np.testing.assert_allclose(np.asarray(g, np.float64), g_want, atol=tol * scale)


def test_preferred_float32_accumulates_bf16_operands_into_float32():
    x = jnp.ones((4, 8), jnp.bfloat16)
    w = jnp.full((8, 3), 1 / 3, jnp.bfloat16)
    assert project(x, w, preferred=jnp.float32).dtype == jnp.float32


def test_the_weight_gradient_runs_on_xla_cpus_gemm_library():
    """Autodiff's weight gradient contracts x's major axes and XLA:CPU runs it as a generic
    `dot`; project's is a materialised x^T times g, a GEMM the library takes (a fusion)."""
    x = jnp.ones((4, 64, 32), jnp.float32)
    w = jnp.ones((32, 48), jnp.float32)

    def hlo(fn):
        grad = jax.jit(jax.grad(lambda w: jnp.sum(fn(x, w) ** 2)))
        return grad.lower(w).compile().as_text()

    plain = hlo(lambda x, w: jnp.einsum("btd,dn->btn", x, w))
    ours = hlo(lambda x, w: project(x, w))
    generic_dot = " dot(%"
    assert plain.split("ENTRY")[1].count(generic_dot) >= 1  # the failure this guards against
    assert ours.split("ENTRY")[1].count(generic_dot) == 0
