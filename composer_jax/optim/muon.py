"""Muon with per-head / per-expert / per-layer orthogonalisation and a sharded Newton-Schulz.

Matrices get momentum orthogonalised by a quintic Newton-Schulz iteration; everything that is not
a matrix (embeddings and the output head, norms, vectors) goes to AdamW. The split and the matrix
granularity come from the parameters' logical axis names: "layers", "heads" and "expert" are batch
axes of Newton-Schulz, so a stacked [layers, q_lora, heads, head_dim] projection is orthogonalised
as layers x heads independent [q_lora, head_dim] matrices.

Sharded execution: a parameter sharded along its matrix dimensions is re-laid out by an all-to-all
so that each device holds whole matrices (a slice of the batch of matrices), Newton-Schulz runs
locally, and a second all-to-all restores the parameter's own sharding. Matrices of the same shape
and matrix sharding are concatenated first, so the batch divides the group more often (it is
padded when it does not), and every shape sharded alike travels in the same collective: one
all-to-all each way per sharding, however many parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# Quintic coefficients of Keller Jordan's Muon (also optax.contrib's "standard" preset).
NS_COEFFS = (3.4445, -4.7750, 2.0315)
# Logical names that index independent matrices (batch axes of Newton-Schulz).
BATCH_AXES = ("layers", "heads", "expert")
# Logical names whose parameters are lookup tables or the output head: AdamW, never Muon.
ADAMW_AXES = ("vocab",)
RELAYOUTS = ("all_to_all", "all_gather")


def _is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
    """Dimension indices of one parameter: Newton-Schulz batch dims, then the (rows, cols) matrix.

    rows is the reduction (fan-in) dimension of `x @ W`, cols the output (fan-out) dimension.
    """

    batch_dims: tuple[int, ...]
    rows: int
    cols: int

    @property
    def perm(self) -> tuple[int, ...]:
        return self.batch_dims + (self.rows, self.cols)


def matrix_layout(axes: Sequence[str], shape: Sequence[int]) -> MatrixLayout | None:
    """How a parameter is orthogonalised, or None when it belongs to AdamW."""
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
    if any(a in ADAMW_AXES for a in axes):
        return None
    batch = tuple(i for i, a in enumerate(axes) if a in BATCH_AXES)
    rest = [i for i in range(len(axes)) if i not in batch]
    if len(rest) < 2:
        return None
    if len(rest) > 2:
        raise ValueError(
            f"logical axes {tuple(axes)}: {len(rest)} matrix axes; Muon needs exactly two besides "
            f"the batch axes {BATCH_AXES}"
        )
    return MatrixLayout(batch, rest[0], rest[1])


class _Box:
    """Opaque leaf, so tuples and shardings can ride along a parameter tree."""

    def __init__(self, value):
        self.value = value


def _per_leaf(prefix_tree, tree, is_prefix_leaf) -> list:
    """Values of a prefix tree (one per parameter) repeated for each leaf of `tree`, in order.

    Masked leaves (optax.MaskedNode) count as leaves, so the list lines up with
    `jax.tree.leaves(tree, is_leaf=_is_masked)`.
    """
    boxed = jax.tree.map(
        lambda p, sub: jax.tree.map(lambda _: _Box(p), sub, is_leaf=_is_masked),
        prefix_tree,
        tree,
        is_leaf=is_prefix_leaf,
    )
    return [b.value for b in jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, _Box))]


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


def param_labels(logical_axes) -> Callable[[Any], Any]:
    """Label function for `optax.partition`: "muon" for matrices, "adamw" for the rest."""

    def labels(params):
        return jax.tree.map(
            lambda axes, sub: jax.tree.map(
                lambda x: "muon" if matrix_layout(axes, x.shape) else "adamw", sub
            ),
            logical_axes,
            params,
            is_leaf=_is_axes,
        )

    return labels


def split_table(params, logical_axes, shardings=None) -> str:
    """Human-readable table: each parameter, its optimizer, and how Muon batches it."""
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    axes_list = _per_leaf(logical_axes, params, _is_axes)
    sh_list = [None] * len(paths) if shardings is None else _per_leaf(shardings, params, _is_sh)
    rows = [("parameter", "shape", "logical axes", "optim", "NS batch x matrix", "sharding")]
    counts = {"muon": 0, "adamw": 0}
    for (path, x), axes, sh in zip(paths, axes_list, sh_list):
        layout = matrix_layout(axes, x.shape)
        name = _path_name(path)
        if layout is None:
            optim, how = "adamw", "-"
        else:
            optim = "muon"
            n = math.prod(x.shape[d] for d in layout.batch_dims)
            how = f"{n} x [{x.shape[layout.rows]}, {x.shape[layout.cols]}]"
        counts[optim] += math.prod(x.shape)
        spec = "-" if sh is None else str(tuple(sh.spec))
        rows.append((name, str(tuple(x.shape)), ",".join(axes), optim, how, spec))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total = max(sum(counts.values()), 1)
    lines.append(
        f"muon: {counts['muon']:,} params ({100 * counts['muon'] / total:.1f}%), "
        f"adamw: {counts['adamw']:,} params"
    )
    return "\n".join(lines)


def _path_name(path) -> str:
    """ "moe_layers.attn.q_b_proj", "mtp.0.proj": dict keys and indices, without nnx's ".value"."""
    parts = []
    for entry in path:
        part = getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", entry)))
        if part != "value":
            parts.append(str(part))
    return ".".join(parts)


def _is_sh(x) -> bool:
    return isinstance(x, NamedSharding)


# ----------------------------------------------------------------------------- Newton-Schulz


def newton_schulz(x_NRC: jax.Array, steps: int = 5, eps: float = 1e-8) -> jax.Array:
    """Approximate orthogonalisation U V^T of each matrix in a batch (quintic, fp32 or wider).

    The Gram matrix is formed on the short side (a tall batch is transposed), the Frobenius
    normalisation puts every singular value in (0, 1] where the iteration converges.
    """
    a, b, c = NS_COEFFS
    x = x_NRC.astype(jnp.promote_types(x_NRC.dtype, jnp.float32))
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + eps)
    for _ in range(steps):
        gram = jnp.einsum("nij,nkj->nik", x, x)
        poly = b * gram + c * jnp.einsum("nij,njk->nik", gram, gram)
        x = a * x + jnp.einsum("nij,njk->nik", poly, x)
    return jnp.swapaxes(x, -1, -2) if tall else x


def _mesh_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


@dataclasses.dataclass(frozen=True)
class _Member:
    index: int  # position among the tree's leaves
    layout: MatrixLayout
    spec: P | None  # of the transposed [batch..., rows, cols] array


def _pad_rows(x: jax.Array, multiple: int) -> jax.Array:
    """Pads the batch to a multiple by repeating matrices (the copies are dropped afterwards).

    Repeats rather than zeros: with zero padding, XLA:CPU's HLO verifier rejected the tuple
    all-to-all it built from the padded batch ("operands with different shapes", mesh (2, 4, 1)).
    """
    n = x.shape[0]
    extra = -n % multiple
    return jnp.take(x, np.arange(n + extra) % n, axis=0) if extra else x


def _all_to_all_jointly(blocks: list[jax.Array], axes: tuple[str, ...]) -> list[jax.Array]:
    """A tiled all-to-all along the leading axis (length k = the group's size) of each block, as
    one collective: the blocks travel side by side in a [k, total] buffer. Fewer, larger
    collectives cost less latency on a GPU, and XLA:CPU spends ~1.4 s compiling each 256-way
    all-to-all whatever its size (what made the 1T plan with Muon compile for minutes)."""
    k = blocks[0].shape[0]
    flat = [b.reshape(k, -1) for b in blocks]
    moved = jax.lax.all_to_all(jnp.concatenate(flat, axis=1), axes, 0, 0, tiled=True)
    parts = jnp.split(moved, np.cumsum([f.shape[1] for f in flat])[:-1], axis=1)
    return [p.reshape(b.shape) for p, b in zip(parts, blocks)]


def _exchange(xs: list[jax.Array], axes: tuple[str, ...], k: int, dim: int) -> list[jax.Array]:
    """Each [n, r, c] batch of blocks -> [n / k, ...] with dimension `dim` whole (k times longer).

    Written as a leading-axis all-to-all plus local transposes: the plain form of the collective.
    """
    moved = _all_to_all_jointly([x.reshape(k, x.shape[0] // k, *x.shape[1:]) for x in xs], axes)
    out = []
    for x in moved:
        # x[i] is chunk (my index) of the batch, rows / cols block i: put i next to `dim`.
        _, m, r, c = x.shape
        shape = (m, r * k, c) if dim == 1 else (m, r, c * k)
        out.append(jnp.moveaxis(x, 0, dim).reshape(shape))
    return out


def _unexchange(xs: list[jax.Array], axes: tuple[str, ...], k: int, dim: int) -> list[jax.Array]:
    """Inverse of `_exchange`: back to the full batches of blocks of dimension `dim`."""
    split = []
    for x in xs:
        m, r, c = x.shape
        x = x.reshape((m, k, r // k, c) if dim == 1 else (m, r, k, c // k))
        split.append(jnp.moveaxis(x, dim, 0))
    return [x.reshape(-1, *x.shape[2:]) for x in _all_to_all_jointly(split, axes)]


def _gathered_newton_schulz(x_NRC, row_axes, col_axes, steps: int) -> jax.Array:
    """The all-gather baseline: every device orthogonalises whole matrices, keeps its block."""
    n, r, c = x_NRC.shape
    full = x_NRC
    if row_axes:
        full = jax.lax.all_gather(full, row_axes, axis=1, tiled=True)
    if col_axes:
        full = jax.lax.all_gather(full, col_axes, axis=2, tiled=True)
    out = newton_schulz(full, steps)
    i = jax.lax.axis_index(row_axes) * r if row_axes else 0
    j = jax.lax.axis_index(col_axes) * c if col_axes else 0
    return jax.lax.dynamic_slice(out, (0, i, j), (n, r, c))


def _orthogonalize_local(
    xs: list[jax.Array],
    row_axes: tuple[str, ...],
    col_axes: tuple[str, ...],
    mesh,
    steps: int,
    relayout: str,
) -> list[jax.Array]:
    """Newton-Schulz of batches of matrix blocks (one per group of same-shaped matrices) that are
    sharded alike along rows / cols, inside shard_map; with "all_to_all", every batch takes part
    in one collective per re-layout."""
    if not row_axes and not col_axes:
        return [newton_schulz(x, steps) for x in xs]
    if relayout == "all_gather":
        return [_gathered_newton_schulz(x, row_axes, col_axes, steps) for x in xs]
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    counts = [x.shape[0] for x in xs]
    xs = [_pad_rows(x, size(row_axes) * size(col_axes)) for x in xs]
    if row_axes:  # each device takes a slice of the batch and the whole rows
        xs = _exchange(xs, row_axes, size(row_axes), 1)
    if col_axes:
        xs = _exchange(xs, col_axes, size(col_axes), 2)
    xs = [newton_schulz(x, steps) for x in xs]
    if col_axes:
        xs = _unexchange(xs, col_axes, size(col_axes), 2)
    if row_axes:
        xs = _unexchange(xs, row_axes, size(row_axes), 1)
    return [x[:n] for x, n in zip(xs, counts)]


def _group_matrices(leaves, axes_list, sh_list) -> tuple[dict, dict[int, jax.Array]]:
    """({(rows, cols, row mesh axes, col mesh axes): members}, {leaf index: the leaf with its
    matrix axes last}) over the unmasked leaves."""
    groups: dict[tuple, list[_Member]] = {}
    inputs: dict[int, jax.Array] = {}
    for i, (x, axes, sh) in enumerate(zip(leaves, axes_list, sh_list)):
        if _is_masked(x):
            continue
        layout = matrix_layout(axes, x.shape)
        if layout is None:
            raise ValueError(f"parameter with axes {axes} and shape {x.shape} is not a matrix")
        xt = jnp.transpose(x, layout.perm)
        spec = None
        if sh is not None:
            full = tuple(sh.spec) + (None,) * (x.ndim - len(sh.spec))
            spec = P(*(full[d] for d in layout.perm))
        row_axes = _mesh_axes(spec[-2]) if spec is not None else ()
        col_axes = _mesh_axes(spec[-1]) if spec is not None else ()
        key = (xt.shape[-2], xt.shape[-1], row_axes, col_axes)
        groups.setdefault(key, []).append(_Member(i, layout, spec))
        inputs[i] = xt
    return groups, inputs


def orthogonalize(
    tree,
    logical_axes,
    shardings=None,
    steps: int = 5,
    relayout: str = "all_to_all",
):
    """Newton-Schulz of every matrix in `tree` (masked leaves are passed through).

    `logical_axes` is a prefix tree of axis-name tuples; `shardings` (optional) a prefix tree of
    the parameters' NamedShardings. Without shardings everything runs as plain batched matmuls;
    with them, one `shard_map` over the mesh re-lays each group of same-shaped matrices with
    `relayout` ("all_to_all": each device orthogonalises a slice of whole matrices;
    "all_gather": every device orthogonalises all of them, the baseline).
    """
    if relayout not in RELAYOUTS:
        raise ValueError(f"relayout must be one of {RELAYOUTS}, got {relayout!r}")
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_masked)
    axes_list = _per_leaf(logical_axes, tree, _is_axes)
    sh_list = [None] * len(leaves) if shardings is None else _per_leaf(shardings, tree, _is_sh)
    groups, inputs = _group_matrices(leaves, axes_list, sh_list)
    order = [m for members in groups.values() for m in members]
    if not order:
        return tree
    mesh = next((sh.mesh for sh in sh_list if sh is not None), None)

    # Groups sharded alike (and of one dtype) share their collectives.
    classes: dict[tuple, list[list[_Member]]] = {}
    for (_, _, row_axes, col_axes), members in groups.items():
        key = (row_axes, col_axes, inputs[members[0].index].dtype)
        classes.setdefault(key, []).append(members)

    def run(*blocks):
        """Per group: concatenate, orthogonalise, split back into the members' blocks."""
        by_index = dict(zip([m.index for m in order], blocks))
        out = {}
        for (row_axes, col_axes, _), member_lists in classes.items():
            parts = [[by_index[m.index] for m in members] for members in member_lists]
            flat = [[p.reshape((-1,) + p.shape[-2:]) for p in group] for group in parts]
            done = _orthogonalize_local(
                [jnp.concatenate(group) for group in flat],
                row_axes,
                col_axes,
                mesh,
                steps,
                relayout,
            )
            for members, group, group_flat, x in zip(member_lists, parts, flat, done):
                start = 0
                for m, p, f in zip(members, group, group_flat):
                    out[m.index] = x[start : start + f.shape[0]].reshape(p.shape)
                    start += f.shape[0]
        return tuple(out[m.index] for m in order)

    args = tuple(inputs[m.index] for m in order)
    if mesh is None:
        results = run(*args)
    else:
        specs = tuple(m.spec for m in order)
        results = jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=specs)(*args)
    new = list(leaves)
    for m, y in zip(order, results):
        inverse = tuple(sorted(range(len(m.layout.perm)), key=lambda d: m.layout.perm[d]))
        new[m.index] = jnp.transpose(y, inverse).astype(leaves[m.index].dtype)
    return jax.tree.unflatten(treedef, new)


# ----------------------------------------------------------------------------- the optimizer


def update_scale(layout: MatrixLayout, shape: Sequence[int], scaling: str) -> float:
    """Per-matrix update multiplier.

    "rms": 0.2 * sqrt(max(rows, cols)), so the update RMS matches AdamW's (Moonlight / Kimi K2)
    and AdamW's learning rate and weight decay carry over. "spectral": sqrt(max(1, cols / rows)),
    the width-transfer rule of the original Muon (optax.contrib.muon's default).
    """
    rows, cols = shape[layout.rows], shape[layout.cols]
    if scaling == "rms":
        return 0.2 * math.sqrt(max(rows, cols))
    if scaling == "spectral":
        return math.sqrt(max(1.0, cols / rows))
    raise ValueError(f"scaling must be 'rms' or 'spectral', got {scaling!r}")


class ScaleByMuonState(NamedTuple):
    count: jax.Array  # int32 scalar
    mu: optax.Updates  # momentum, shaped (and sharded) like the matrices


def scale_by_muon(
    logical_axes,
    shardings=None,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    scaling: str = "rms",
    relayout: str = "all_to_all",
) -> optax.GradientTransformation:
    """Momentum (bias-corrected EMA, as optax.contrib), Newton-Schulz, per-matrix scaling."""
    update_scale(MatrixLayout((), 0, 1), (1, 1), scaling)  # reject a bad name at build time

    def init_fn(params):
        return ScaleByMuonState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params))

    def update_fn(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = state.count + 1
        if nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: beta * m + (1 - beta) * g,
                optax.tree.bias_correction(mu, beta, count + 1),
                optax.tree.bias_correction(updates, beta, count),
            )
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        ortho = orthogonalize(mu_hat, logical_axes, shardings, ns_steps, relayout)
        scales = _per_leaf(logical_axes, ortho, _is_axes)
        leaves, treedef = jax.tree.flatten(ortho, is_leaf=_is_masked)
        scaled = [
            x if _is_masked(x) else x * update_scale(matrix_layout(a, x.shape), x.shape, scaling)
            for x, a in zip(leaves, scales)
        ]
        return jax.tree.unflatten(treedef, scaled), ScaleByMuonState(count, mu)

    return optax.GradientTransformation(init_fn, update_fn)


def decay_mask(logical_axes) -> Callable[[Any], Any]:
    """Mask function for AdamW's weight decay: matrices only, a matrix being a parameter with
    two axes or more besides the layer stack; a norm's scale stacked over layers
    (`("layers", "embed")`) is a vector per layer and is not decayed, like an unstacked one."""

    def mask(params):
        return jax.tree.map(
            lambda axes, sub: jax.tree.map(lambda _: sum(a != "layers" for a in axes) >= 2, sub),
            logical_axes,
            params,
            is_leaf=_is_axes,
        )

    return mask


def muon(
    learning_rate: optax.ScalarOrSchedule,
    logical_axes,
    *,
    shardings=None,
    beta: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    scaling: str = "rms",
    weight_decay: float = 0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps: float = 1e-8,
    adam_weight_decay: float = 0.0,
    relayout: str = "all_to_all",
) -> optax.GradientTransformation:
    """Muon on matrices (decoupled weight decay), AdamW on everything else.

    `logical_axes` is a tree of axis-name tuples matching the parameters (prefix of them: one tuple
    per `nnx.Param`); `shardings` the parameters' NamedShardings (or None: single device).
    AdamW decays only matrices (`decay_mask`), like `make_optimizer`'s plain AdamW.
    """
    adam_learning_rate = learning_rate if adam_learning_rate is None else adam_learning_rate
    return optax.partition(
        {
            "muon": optax.chain(
                scale_by_muon(logical_axes, shardings, beta, nesterov, ns_steps, scaling, relayout),
                optax.add_decayed_weights(weight_decay),
                optax.scale_by_learning_rate(learning_rate),
            ),
            "adamw": optax.adamw(
                adam_learning_rate,
                b1=adam_b1,
                b2=adam_b2,
                eps=adam_eps,
                weight_decay=adam_weight_decay,
                mask=decay_mask(logical_axes),
            ),
        },
        param_labels(logical_axes),
    )
