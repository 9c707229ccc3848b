"""Human-readable views of a layout: per-parameter shardings and per-step communication."""

from __future__ import annotations

import math
import re
from collections import defaultdict

import jax
import numpy as np


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


_DTYPE_BYTES = {
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "s8": 1,
    "u8": 1,
    "pred": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s64": 8,
    "f64": 8,
}
_COLLECTIVE = re.compile(
    r"=\s*(?P<result>\(?[^=]*?\)?)\s+(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\("
)
_SHAPE = re.compile(r"(?P<dtype>[a-z0-9]+)\[(?P<dims>[0-9,]*)\]")


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Bytes produced per device by each kind of collective in a compiled HLO module."""
    totals: dict[str, int] = defaultdict(int)
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if not match or "-done" in line:
            continue
        for shape in _SHAPE.finditer(match["result"]):
            dims = [int(d) for d in shape["dims"].split(",") if d]
            totals[match["op"]] += math.prod(dims) * _DTYPE_BYTES.get(shape["dtype"], 4)
    return dict(totals)
