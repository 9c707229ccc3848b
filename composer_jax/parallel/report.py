"""Human-readable views of a layout: per-parameter shardings and per-step communication."""

from __future__ import annotations

import math

import jax
import numpy as np

from composer_jax.parallel import hlo


def _per_device_bytes(x) -> int:
    shard = x.sharding.shard_shape(x.shape)
    return math.prod(shard) * np.dtype(x.dtype).itemsize


def path_name(path) -> str:
    """'moe_layers.mlp.gate' for a pytree key path (NNX variable wrappers skipped)."""
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                value = str(getattr(entry, attr))
                if value != "value":
                    parts.append(value)
                break
    return ".".join(parts)


def sharding_table(abstract_tree) -> str:
    """One row per array: path, global shape, partition spec, bytes held by each device."""
    rows = []
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(abstract_tree):
        name = path_name(path)
        per_device = _per_device_bytes(x)
        total += per_device
        spec = str(tuple(x.sharding.spec)) if hasattr(x.sharding, "spec") else str(x.sharding)
        rows.append((name, str(tuple(x.shape)), spec, f"{per_device:,}"))
    rows.append(("total", "", "", f"{total:,}"))
    widths = [
        max(len(r[i]) for r in rows + [("path", "shape", "spec", "bytes/device")]) for i in range(4)
    ]
    header = ("path", "shape", "spec", "bytes/device")
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def bytes_per_device(abstract_tree) -> int:
    return sum(_per_device_bytes(x) for x in jax.tree.leaves(abstract_tree))


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes produced per device by each kind of collective in one run of a compiled HLO module
    (loop bodies counted as often as they run; see `hlo.analyze`)."""
    return {kind: int(b) for kind, b in hlo.analyze(hlo_text).bytes_by_kind().items()}
