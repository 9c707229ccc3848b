"""Small building blocks shared by attention, MoE and the transformer.

Every parameter is an `nnx.Param` carrying `logical_axes` metadata (one name per dimension);
`composer_jax.parallel` maps those names to mesh axes. Stacked (scanned) layers get a leading
"layers" axis that `logical_axes_of` adds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from composer_jax.model.projection import project
from composer_jax.parallel.mesh import constrain


def dtype_of(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def compute_weight(variable: nnx.Variable, dtype) -> jax.Array:
    """A parameter in the compute dtype, cast where it is stored: under a layout the cast keeps
    the parameter's sharding, so the step need not hold a gathered float32 copy (the 1T plan at
    512 devices: the embedding's, 4.4 GiB). XLA:CPU's partitioner still gathers most weights in
    float32 and casts after; the compute-dtype copy is what a step can gather."""
    w = variable[...].astype(dtype)
    axes = tuple(variable.get_metadata().get("logical_axes", ()))
    return constrain(w, axes) if len(axes) == w.ndim else w


def param(
    rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], std: float, dtype: str
) -> nnx.Param:
    """A normally initialised parameter with its logical axis names."""
    assert len(shape) == len(axes), (shape, axes)
    value = std * jax.random.normal(rngs.params(), shape, dtype_of(dtype))
    return nnx.Param(value, logical_axes=axes)


def fan_in_param(
    rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], fan_in: int, dtype: str
) -> nnx.Param:
    """Scaled by 1/sqrt(fan_in) so activations keep unit scale whatever the width."""
    return param(rngs, shape, axes, fan_in**-0.5, dtype)


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32 and cast back to the compute dtype."""

    def __init__(self, dim: int, eps: float, axis_name: str, param_dtype: str):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), dtype_of(param_dtype)), logical_axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class DenseMLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, dim: int, hidden: int, param_dtype: str, rngs: nnx.Rngs):
        self.gate = fan_in_param(rngs, (dim, hidden), ("embed", "mlp"), dim, param_dtype)
        self.up = fan_in_param(rngs, (dim, hidden), ("embed", "mlp"), dim, param_dtype)
        self.down = fan_in_param(rngs, (hidden, dim), ("mlp", "embed"), hidden, param_dtype)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        dt = x_BTD.dtype
        gate, up = (project(x_BTD, compute_weight(w, dt)) for w in (self.gate, self.up))
        return project(jax.nn.silu(gate) * up, compute_weight(self.down, dt))


def logical_axes_of(state: nnx.State) -> nnx.State:
    """Pytree of logical axis tuples matching `state`, with "layers" prepended for stacked params."""

    def axes(v):
        names = tuple(v.get_metadata().get("logical_axes", ()))
        extra = len(jax.tree.leaves(v)[0].shape) - len(names)
        return ("layers",) * extra + names

    return jax.tree.map(axes, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
