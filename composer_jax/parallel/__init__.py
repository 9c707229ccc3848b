"""Mesh, layouts (logical-axis rule tables), context and expert parallelism, batch packing."""

from composer_jax.parallel.mesh import (
    Layout,
    constrain,
    current_layout,
    make_layout,
    make_mesh,
    use_layout,
)

__all__ = ["Layout", "constrain", "current_layout", "make_layout", "make_mesh", "use_layout"]
