"""Mesh construction and logical-axis sharding rules."""

from composer_jax.parallel.mesh import batch_sharding, logical_sharding, make_mesh, spec_for

__all__ = ["batch_sharding", "logical_sharding", "make_mesh", "spec_for"]
