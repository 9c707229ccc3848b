"""One physical mesh, the layout that maps logical axis names onto it, and its rule tables.

Dense state (attention, shared expert, embeddings, norms) shards over (fsdp, cp) and is replicated
over replica (HSDP). Expert state shards its expert axis over the expert-parallel group (`ep` axes,
default (fsdp, cp)) and each expert's matrices over the remaining axes (expert-FSDP). Activations
shard batch over (replica, fsdp) and sequence over cp. Changing a layout is changing a table here,
never model code.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.config import MeshConfig, mesh_shape

AXES = ("replica", "fsdp", "cp")
BATCH_AXES = ("replica", "fsdp")

DENSE_NAMES = ("vocab", "embed", "mlp", "heads", "q_lora", "kv_lora")
EXPERT_MATRIX_NAMES = ("expert_embed", "expert_mlp")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh plus the expert-parallel choice: everything sharding decisions depend on."""

    mesh: Mesh
    ep_axes: tuple[str, ...] = ("fsdp", "cp")
    ep_quantize: str = "auto"
    ep_dispatch: str = "auto"
    ep_capacity: float | None = None

    @property
    def dispatch_mode(self) -> str:
        """The token exchange for EP ("auto": ragged on GPUs, padded elsewhere)."""
        if self.ep_dispatch == "auto":
            return "ragged" if self.mesh.devices.flat[0].platform == "gpu" else "padded"
        return self.ep_dispatch

    @property
    def quantize_dispatch(self) -> bool:
        """Whether tokens travel to their experts in MXFP8 ("auto": on GPUs only)."""
        if self.ep_quantize == "auto":
            return self.mesh.devices.flat[0].platform == "gpu"
        return self.ep_quantize == "mxfp8"

    @property
    def drop_capacity(self) -> float | None:
        """The capacity bound in force on the expert exchange: None without expert parallelism
        or without a factor (dropless)."""
        return self.ep_capacity if self.ep_size > 1 else None

    @property
    def ep_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.ep_axes)

    @property
    def cp_size(self) -> int:
        return self.mesh.shape["cp"]

    @property
    def rules(self) -> dict[str, tuple[str, ...]]:
        """Logical name -> mesh axes, dense, expert and activation tables together."""
        remaining = tuple(a for a in AXES if a not in self.ep_axes)
        table = {name: ("fsdp", "cp") for name in DENSE_NAMES}
        table["expert"] = self.ep_axes
        table.update({name: remaining for name in EXPERT_MATRIX_NAMES})
        table["batch"] = BATCH_AXES
        table["seq"] = ("cp",)
        return table

    def spec(self, logical_axes: tuple[str | None, ...], shape: tuple[int, ...]) -> P:
        """Partition spec of one array: each dimension, in order, takes the largest group of its
        rule's axes that are still free, have size > 1 and together divide it (all of them when
        they do); axes it leaves stay free for later dimensions. A dimension no axis divides is
        replicated. (All-or-nothing replicated Kimi K2's MLA up-projections on fsdp 64 x cp 16:
        1536 and 64 heads divide by 64 and 16, not by 1024.)"""
        used: set[str] = set()
        parts: list = []
        for name, dim in zip(logical_axes, shape):
            candidates = self.rules.get(name, ()) if name is not None else ()
            free = tuple(a for a in candidates if a not in used and self.mesh.shape[a] > 1)
            axes = self._largest_dividing(free, dim)
            parts.append((axes if len(axes) > 1 else axes[0]) if axes else None)
            used.update(axes)
        return P(*parts)

    def _largest_dividing(self, axes: tuple[str, ...], dim: int) -> tuple[str, ...]:
        """The sub-tuple of `axes` (order kept) with the largest product dividing `dim`; the
        longest first among equal products, () when none divides."""
        groups = (c for r in range(len(axes), 0, -1) for c in itertools.combinations(axes, r))
        dividing = [c for c in groups if dim % math.prod(self.mesh.shape[a] for a in c) == 0]
        return max(dividing, key=lambda c: math.prod(self.mesh.shape[a] for a in c), default=())

    def sharding(self, logical_axes, shape) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(tuple(logical_axes), tuple(shape)))

    def tree_shardings(self, logical_axes_tree, shapes_tree):
        """NamedShardings for a pytree from matching trees of logical names and arrays."""
        return jax.tree.map(
            lambda axes, x: self.sharding(axes, x.shape),
            logical_axes_tree,
            shapes_tree,
            is_leaf=lambda a: isinstance(a, tuple),
        )

    def batch_sharding(self) -> NamedSharding:
        """[batch, seq] arrays: batch over (replica, fsdp), sequence over cp."""
        return NamedSharding(self.mesh, P(BATCH_AXES, "cp"))


def with_shardings(shardings, shapes):
    """`shapes` (arrays or ShapeDtypeStructs) as ShapeDtypeStructs carrying `shardings`, a tree
    of NamedShardings whose leaves may each cover a subtree of `shapes` (an nnx Variable): the
    abstract inputs a step is lowered from without allocating them."""
    return jax.tree.map(
        lambda sharding, sub: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), sub
        ),
        shardings,
        shapes,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


def committed_alike(tree):
    """`tree` with its uncommitted arrays committed to the one device its committed arrays are on
    (weights loaded onto a device are committed; counters and caches made by jnp are not). jit
    keys its cache on whether each argument is committed and commits every output once an input
    is, so a function fed such a mix compiles again when fed its own outputs. Trees with no
    committed array, or with committed arrays on several devices (whose callers give explicit
    shardings), are left as they are, and so are committed arrays and traced values."""
    leaves = [leaf for leaf in jax.tree.leaves(tree) if _concrete(leaf)]
    devices = {device for leaf in leaves if leaf.committed for device in leaf.devices()}
    if len(devices) != 1:
        return tree
    (device,) = devices
    return jax.tree.map(
        lambda leaf: (
            jax.device_put(leaf, device) if _concrete(leaf) and not leaf.committed else leaf
        ),
        tree,
    )


def _concrete(leaf) -> bool:
    """An array with a placement (not a value being traced)."""
    return isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)


def committed_mesh(tree) -> Mesh | None:
    """The one mesh that the committed arrays of `tree` laid out over several devices share
    (weights sharded by a trainer), or None: nothing committed across devices, or several meshes.
    A state that a function derives from such weights (an inference cache) is placed over it so
    that its sharding is fixed before the first call, not chosen by that call's compilation."""
    meshes = {
        leaf.sharding.mesh
        for leaf in jax.tree.leaves(tree)
        if _concrete(leaf)
        and leaf.committed
        and isinstance(leaf.sharding, NamedSharding)
        and len(leaf.sharding.device_set) > 1
    }
    return meshes.pop() if len(meshes) == 1 else None


def pinned(tree, sharding: NamedSharding | None):
    """`tree` constrained to `sharding` inside a jitted function (None: left to the compiler).
    For state a function returns to be fed back in (a donated cache): jit keys its compilations
    on each argument's sharding, so an output laid out unlike its input compiles every shape
    again on the next call."""
    return tree if sharding is None else jax.lax.with_sharding_constraint(tree, sharding)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """Mesh over all (or the given) devices with axes (replica, fsdp, cp).

    On several hosts, `replica` spans hosts (slow network: only gradient all-reduce crosses it)
    and fsdp x cp stay inside a host's fast interconnect whenever they fit there.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(cfg, len(devices))
    dims = [shape[a] for a in AXES]
    processes = len({d.process_index for d in devices})
    if processes > 1 and shape["replica"] % processes == 0:
        from jax.experimental import mesh_utils

        per_host = [shape["replica"] // processes, shape["fsdp"], shape["cp"]]
        grid = mesh_utils.create_hybrid_device_mesh(per_host, [processes, 1, 1], devices=devices)
        return Mesh(grid, AXES)
    return Mesh(np.asarray(devices).reshape(dims), AXES)


def make_layout(cfg: MeshConfig, devices=None) -> Layout:
    return Layout(
        make_mesh(cfg, devices), tuple(cfg.ep), cfg.ep_quantize, cfg.ep_dispatch, cfg.ep_capacity
    )


_CURRENT: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("layout", default=None)


@contextlib.contextmanager
def use_layout(layout: Layout | None):
    """Makes `layout` visible to model code traced inside (activation constraints, EP, CP)."""
    token = _CURRENT.set(layout)
    try:
        yield layout
    finally:
        _CURRENT.reset(token)


def current_layout() -> Layout | None:
    return _CURRENT.get()


def constrain(x: jax.Array, logical_axes: tuple[str | None, ...]) -> jax.Array:
    """Pins an activation's sharding under the current layout; a no-op without one."""
    layout = current_layout()
    if layout is None:
        return x
    return jax.lax.with_sharding_constraint(x, layout.sharding(logical_axes, x.shape))
