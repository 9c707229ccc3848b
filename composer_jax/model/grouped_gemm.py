"""Grouped matmul for XLA:CPU, where `lax.ragged_dot` multiplies every row by every group.

XLA:CPU expands `ragged_dot` densely (rows x groups x K x N work, then a mask). Here the rows,
sorted by group, are laid out in expert-aligned tiles of `tile_rows` rows: each group starts on
a fresh tile and a tile's spare slots hold zeros. The product is then one batched matmul of each
tile against its own group's weights, (rows + groups x tile_rows) x K x N work. Moving rows into
tiles and back is a pair of gathers whose shapes depend only on the static row count, so any
group-size vector runs on the same compiled program and no row is ever dropped.

A custom VJP keeps the backward in the tiled layout too: the input gradient is the same product
against the transposed weights, and the weight gradient is each tile's lhs^T @ grad summed over
its group's tiles. Every product accumulates in float32.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class TilePlan(NamedTuple):
    """Where each sorted row sits in the tiled layout (shapes static, values dynamic)."""

    group_of_tile: jax.Array  # [tiles] group whose weights each tile uses (unused tiles: last)
    source_row: jax.Array  # [tiles * tile_rows] sorted row in each slot; num_rows = empty slot
    slot_of_row: jax.Array  # [rows] slot holding each row; tiles * tile_rows = past the groups


def tile_count(num_rows: int, num_groups: int, tile_rows: int) -> int:
    """Static bound on the tiles any group sizes (summing to at most `num_rows`) can need.

    sum_g ceil(n_g / t) <= floor((sum_g n_g + (t - 1) * nonempty groups) / t), and at most
    min(groups, rows) groups are non-empty.
    """
    return (num_rows + min(num_groups, num_rows) * (tile_rows - 1)) // tile_rows


# Each tile multiplies its own gathered copy of its group's weights (and the weight gradient
# keeps a float32 partial per tile): the tiles may hold at most this many times the weights.
MAX_WEIGHT_COPIES = 16


def default_tile_rows(num_rows: int, num_groups: int) -> int:
    """Tile height: large tiles make few, efficient matmuls; small ones compute fewer zero rows
    (the static tile count covers rows + groups x tile_rows). A quarter of the mean group, a
    multiple of 8 in [8, 128], bounds that at ~1.25x the rows; it was the fastest or within
    noise of it in bench_expert_gemm's shapes (a sweep of 32..512). Past a mean group of
    ~2,000 rows, tiles grow instead so that they hold at most `MAX_WEIGHT_COPIES` x the weights
    (at the 1T shape 128-row tiles gathered 100x the experts' weights, 18 GiB a product)."""
    groups = max(num_groups, 1)
    quarter_group = num_rows // (4 * groups)
    fastest = min(128, max(8, quarter_group // 8 * 8))
    # tiles <= rows / tile_rows + groups <= MAX_WEIGHT_COPIES x groups
    fewest = -(-num_rows // ((MAX_WEIGHT_COPIES - 1) * groups))
    return int(max(fastest, -(-fewest // 8) * 8))


def plan_tiles(group_sizes_G: jax.Array, num_rows: int, tile_rows: int) -> TilePlan:
    """The tiled layout for rows sorted by group; rows past sum(group_sizes) belong to no tile."""
    num_groups = group_sizes_G.shape[0]
    num_tiles = tile_count(num_rows, num_groups, tile_rows)
    sizes = group_sizes_G.astype(jnp.int32)
    group_end = jnp.cumsum(sizes)
    group_start = group_end - sizes
    tiles_of_group = (sizes + tile_rows - 1) // tile_rows
    tile_end = jnp.cumsum(tiles_of_group)
    tile_start = tile_end - tiles_of_group

    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_end, tile, side="right"), num_groups - 1)
    offset = (tile - tile_start[group])[:, None] * tile_rows + jnp.arange(tile_rows)
    in_group = (offset < sizes[group][:, None]) & (tile < tile_end[-1])[:, None]
    source = jnp.where(in_group, group_start[group][:, None] + offset, num_rows)

    row = jnp.arange(num_rows, dtype=jnp.int32)
    group_of_row = jnp.minimum(jnp.searchsorted(group_end, row, side="right"), num_groups - 1)
    slot = tile_start[group_of_row] * tile_rows + row - group_start[group_of_row]
    slot = jnp.where(row < group_end[-1], slot, num_tiles * tile_rows)
    return TilePlan(group.astype(jnp.int32), source.reshape(-1), slot.astype(jnp.int32))


def _to_tiles(x_MK: jax.Array, plan: TilePlan, tile_rows: int) -> jax.Array:
    """[rows, K] -> [tiles, tile_rows, K], empty slots zero."""
    tiles = x_MK.at[plan.source_row].get(mode="fill", fill_value=0)
    return tiles.reshape(-1, tile_rows, x_MK.shape[-1])


def _from_tiles(y_TRN: jax.Array, plan: TilePlan) -> jax.Array:
    """[tiles, tile_rows, N] -> [rows, N], rows past the groups zero."""
    flat = y_TRN.reshape(-1, y_TRN.shape[-1])
    return flat.at[plan.slot_of_row].get(mode="fill", fill_value=0)


def _transposed_tiles(x_MK: jax.Array, plan: TilePlan, tile_rows: int) -> jax.Array:
    """[tiles, K, tile_rows], each tile transposed and laid out row-major. The barrier keeps XLA
    from folding the transpose into the product, and it holds the tiles flattened to 2D: given
    the 3D transpose, XLA:CPU's layout assignment lays it out so the transpose is free, which
    leaves the product's contracted axis major and the product off the GEMM library (in float32,
    about 2x slower); a flat [tiles * K, tile_rows] array cannot be laid out that way."""
    tiles_TMK = _to_tiles(x_MK, plan, tile_rows)
    T, M, K = tiles_TMK.shape
    flat = jax.lax.optimization_barrier(jnp.swapaxes(tiles_TMK, 1, 2).reshape(T * K, M))
    return flat.reshape(T, K, M)


def _tiled_product(x_MK, w_GKN, plan: TilePlan, tile_rows: int, spec: str, out_dtype):
    """Each tile times its group's weight matrix (`spec` contracts tile rows with the weights)."""
    y = jnp.einsum(
        spec,
        _to_tiles(x_MK, plan, tile_rows),
        w_GKN[plan.group_of_tile],
        preferred_element_type=jnp.float32,
    )
    return _from_tiles(y.astype(out_dtype), plan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul(lhs_MK, rhs_GKN, group_sizes_G, tile_rows: int):
    plan = plan_tiles(group_sizes_G, lhs_MK.shape[0], tile_rows)
    return _tiled_product(lhs_MK, rhs_GKN, plan, tile_rows, "tmk,tkn->tmn", lhs_MK.dtype)


def _grouped_matmul_fwd(lhs_MK, rhs_GKN, group_sizes_G, tile_rows):
    out = _grouped_matmul(lhs_MK, rhs_GKN, group_sizes_G, tile_rows)
    return out, (lhs_MK, rhs_GKN, group_sizes_G)


def _grouped_matmul_bwd(tile_rows, residuals, grad_MN):
    lhs_MK, rhs_GKN, group_sizes_G = residuals
    num_groups = rhs_GKN.shape[0]
    plan = plan_tiles(group_sizes_G, lhs_MK.shape[0], tile_rows)
    grad_lhs = _tiled_product(grad_MN, rhs_GKN, plan, tile_rows, "tmn,tkn->tmk", lhs_MK.dtype)
    # Weight gradient: per-tile lhs^T @ grad, then each group's tiles summed (tiles are sorted by
    # group, and unused tiles hold zero rows, so their products are zero). lhs^T is materialised
    # so each tile's product contracts its lhs's last axis, the form XLA:CPU's GEMM library takes
    # (model/projection.py says why).
    per_tile = jnp.einsum(
        "tkm,tmn->tkn",
        _transposed_tiles(lhs_MK, plan, tile_rows),
        _to_tiles(grad_MN, plan, tile_rows),
        preferred_element_type=jnp.float32,
    )
    grad_rhs = jax.ops.segment_sum(
        per_tile, plan.group_of_tile, num_segments=num_groups, indices_are_sorted=True
    )
    return grad_lhs, grad_rhs.astype(rhs_GKN.dtype), None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def grouped_matmul(
    lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G: jax.Array, tile_rows: int | None = None
) -> jax.Array:
    """Rows [sum(sizes[:g]), sum(sizes[:g+1])) of `lhs` times `rhs[g]`, in `lhs`'s dtype.

    The contract of `lax.ragged_dot` with float32 accumulation: rows past sum(group_sizes) give
    zeros; sum(group_sizes) must not exceed the row count. Differentiable in `lhs` and `rhs`.
    """
    if lhs_MK.ndim != 2 or rhs_GKN.ndim != 3 or lhs_MK.shape[1] != rhs_GKN.shape[1]:
        raise ValueError(
            f"grouped_matmul wants lhs [M, K] and rhs [G, K, N]; got {lhs_MK.shape} and "
            f"{rhs_GKN.shape}"
        )
    if group_sizes_G.shape != (rhs_GKN.shape[0],):
        raise ValueError(
            f"group_sizes must have shape ({rhs_GKN.shape[0]},) (one per rhs group); got "
            f"{group_sizes_G.shape}"
        )
    if not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers, got {group_sizes_G.dtype}")
    num_rows, num_groups = lhs_MK.shape[0], rhs_GKN.shape[0]
    if num_rows == 0 or num_groups == 0:
        return jnp.zeros((0, rhs_GKN.shape[2]), lhs_MK.dtype)
    if tile_rows is None:
        tile_rows = default_tile_rows(num_rows, num_groups)
    if tile_rows < 1:
        raise ValueError(f"tile_rows must be >= 1, got {tile_rows}")
    return _grouped_matmul(lhs_MK, rhs_GKN, group_sizes_G, tile_rows)
