"""One physical mesh and the logical-axis rule tables that place state and activations on it.

Dense state (attention, shared expert, embeddings, norms) shards over (fsdp, cp) and is replicated
over replica; expert state shards its expert axis over the wider (fsdp, cp) group. Changing a
layout means changing a table here, never model code.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.config import MeshConfig, mesh_shape

AXES = ("replica", "fsdp", "cp")

# Logical name -> mesh axes. The first dimension of a parameter whose name maps to axes that
# divide it (and that no earlier dimension used) gets sharded; the rest are replicated.
DENSE_RULES: dict[str, tuple[str, ...]] = {
    "vocab": ("fsdp", "cp"),
    "embed": ("fsdp", "cp"),
    "mlp": ("fsdp", "cp"),
    "heads": ("fsdp", "cp"),
    "q_lora": ("fsdp", "cp"),
    "kv_lora": ("fsdp", "cp"),
}
EXPERT_RULES: dict[str, tuple[str, ...]] = {
    "expert": ("fsdp", "cp"),
    "expert_embed": ("fsdp", "cp"),
    "expert_mlp": ("fsdp", "cp"),
}
ACTIVATION_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("replica", "fsdp"),
    "seq": ("cp",),
}


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """Mesh over all (or the given) devices with axes (replica, fsdp, cp)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    return Mesh(np.asarray(devices).reshape([shape[a] for a in AXES]), AXES)


def spec_for(logical_axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """Partition spec for one array from its logical names, skipping non-dividing placements."""
    used: set[str] = set()
    parts: list = []
    for name, dim in zip(logical_axes, shape):
        axes = DENSE_RULES.get(name) or EXPERT_RULES.get(name) or ACTIVATION_RULES.get(name) or ()
        axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if axes and dim % size == 0:
            parts.append(axes if len(axes) > 1 else axes[0])
            used.update(axes)
        else:
            parts.append(None)
    return P(*parts)


def logical_sharding(logical_axes_tree, shapes_tree, mesh: Mesh):
    """NamedShardings for a pytree, given matching trees of logical names and array shapes."""
    return jax.tree.map(
        lambda axes, x: NamedSharding(mesh, spec_for(axes, x.shape, mesh)),
        logical_axes_tree,
        shapes_tree,
        is_leaf=lambda a: isinstance(a, tuple),
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[batch, seq] arrays: batch over (replica, fsdp), sequence over cp."""
    return NamedSharding(mesh, P(("replica", "fsdp"), "cp"))
