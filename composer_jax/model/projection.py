"""Activation x weight products whose weight gradient runs on XLA:CPU's fast GEMM path.

XLA:CPU hands a dot to its GEMM library (YNNPACK) only when the left operand contracts its
minor-most axes. Autodiff writes a weight gradient as x^T g contracting the batch axes of x,
its major ones, so each one falls back to XLA's generic dot: the weight gradients were the
largest ops of the benchmarked model's backward (`experiments/op_profile.py`). `project`
computes them from a materialised x^T instead, on the CPU only; GPU GEMMs read transposed
operands natively, so every other platform keeps autodiff's form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def project(x: jax.Array, w: jax.Array, contract: int = 1, preferred=None) -> jax.Array:
    """x [..., K1..Kc] times w [K1..Kc, N...] -> [..., N...]: the last `contract` axes of x meet
    the first of w (`jnp.einsum("...k,kn->...n")` for one). `preferred`: the accumulation and
    output dtype (default: the operands' result type)."""
    return _project(x, w, contract, preferred and jnp.dtype(preferred))


def _dims(x: jax.Array, contract: int):
    lead = x.ndim - contract
    return ((tuple(range(lead, x.ndim)), tuple(range(contract))), ((), ()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _project(x, w, contract, preferred):
    return lax.dot_general(x, w, _dims(x, contract), preferred_element_type=preferred)


def _project_fwd(x, w, contract, preferred):
    return _project(x, w, contract, preferred), (x, w)


def _weight_grad_row_major(x, g, lead: int):
    """sum over the lead axes of x [lead..., K...] g [lead..., N...], as x^T [K..., lead...]
    (materialised: the barrier keeps XLA from folding the transpose back into the dot) times g."""
    order = tuple(range(lead, x.ndim)) + tuple(range(lead))
    x_t = lax.optimization_barrier(jnp.transpose(x, order))
    lead_axes_of_x_t = tuple(range(x.ndim - lead, x.ndim))
    dims = ((lead_axes_of_x_t, tuple(range(lead))), ((), ()))
    return lax.dot_general(x_t, g, dims, preferred_element_type=jnp.float32)


def _weight_grad(x, g, lead: int):
    dims = ((tuple(range(lead)), tuple(range(lead))), ((), ()))
    return lax.dot_general(x, g, dims, preferred_element_type=jnp.float32)


def _project_bwd(contract, preferred, residuals, g):
    x, w = residuals
    lead = x.ndim - contract
    # dx: g [lead..., N...] against w [K..., N...] over N: g contracts its minor axes already.
    n_axes = tuple(range(lead, g.ndim))
    dx = lax.dot_general(
        g, w, ((n_axes, tuple(range(contract, w.ndim))), ((), ())),
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    dw = lax.platform_dependent(
        x,
        g,
        cpu=functools.partial(_weight_grad_row_major, lead=lead),
        default=functools.partial(_weight_grad, lead=lead),
    )
    return dx.astype(x.dtype), dw.astype(w.dtype)


_project.defvjp(_project_fwd, _project_bwd)
