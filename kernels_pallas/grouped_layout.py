"""Memory layouts for grouped GEMMs (pure jnp), and the reference grouped product.

Rows: kernels tile the token axis; a tile must not straddle two experts (nor, for token-axis
scale blocks, may a scale block). Each expert's rows are therefore moved to a start that is a
multiple of `align`, zero rows filling the gaps; rows past sum(group_sizes) are dropped.
Scales: the swizzled tiles of block scales that Blackwell's block-scaled MMAs read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def padded_row_count(num_rows: int, num_groups: int, align: int) -> int:
    """Static upper bound on the aligned layout's rows (a multiple of `align`)."""
    bound = num_rows + (align - 1) * min(num_groups, num_rows)
    return -(-bound // align) * align


def expert_of_row(group_sizes_G: jax.Array, num_rows: int) -> jax.Array:
    """Group index of each sorted row, clamped to the last group for rows past the groups."""
    ends = jnp.cumsum(group_sizes_G)
    rows = jnp.arange(num_rows, dtype=ends.dtype)
    return jnp.minimum(jnp.searchsorted(ends, rows, side="right"), group_sizes_G.shape[0] - 1)


def aligned_destinations(
    group_sizes_G: jax.Array, num_rows: int, align: int
) -> tuple[jax.Array, jax.Array, int]:
    """(destination row of each source row, aligned group sizes, padded row count).

    Rows past the groups get the out-of-range destination `padded row count`.
    """
    padded_rows = padded_row_count(num_rows, group_sizes_G.shape[0], align)
    starts = jnp.cumsum(group_sizes_G) - group_sizes_G
    aligned_sizes = -(-group_sizes_G // align) * align
    aligned_starts = jnp.cumsum(aligned_sizes) - aligned_sizes
    group = expert_of_row(group_sizes_G, num_rows)
    row = jnp.arange(num_rows, dtype=starts.dtype)
    dest = aligned_starts[group] + row - starts[group]
    dest = jnp.where(row < jnp.sum(group_sizes_G), dest, padded_rows)
    return dest, aligned_sizes.astype(group_sizes_G.dtype), padded_rows


def to_aligned_rows(x_MK: jax.Array, dest_M: jax.Array, padded_rows: int) -> jax.Array:
    """Scatter rows to their aligned positions (zeros elsewhere)."""
    out = jnp.zeros((padded_rows,) + x_MK.shape[1:], x_MK.dtype)
    return out.at[dest_M].set(x_MK, mode="drop")


def from_aligned_rows(x_PN: jax.Array, dest_M: jax.Array) -> jax.Array:
    """Gather rows back to the sorted layout; rows past the groups become zeros."""
    return x_PN.at[dest_M].get(mode="fill", fill_value=0)


def grouped_gemm_reference(lhs_MK: jax.Array, rhs_GKN: jax.Array, group_sizes_G) -> jax.Array:
    """float32 grouped product: rows of group g times rhs[g]; rows past the groups are zero."""
    return jax.lax.ragged_dot(
        lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32), preferred_element_type=jnp.float32
    )


def swizzle_scales(scales_RC: jax.Array) -> jax.Array:
    """(rows, cols) scale matrix -> the (rows/128, cols/4, 32, 16) tiles the tensor cores read.

    Within a 128x4 tile, row 32*j + i and column c land at [i, 4*j + c]: the four 32-row slices
    sit side by side, each row holding its four consecutive K-block scales.
    """
    rows, cols = scales_RC.shape[-2:]
    if rows % 128 or cols % 4:
        raise ValueError(f"scale matrix {scales_RC.shape} must be a multiple of (128, 4)")
    lead = scales_RC.shape[:-2]
    tiles = scales_RC.reshape(lead + (rows // 128, 4, 32, cols // 4, 4))
    n = len(lead)
    order = tuple(range(n)) + tuple(n + a for a in (0, 3, 2, 1, 4))
    return tiles.transpose(order).reshape(lead + (rows // 128, cols // 4, 32, 16))


def unswizzle_scales(tiles: jax.Array) -> jax.Array:
    """Inverse of `swizzle_scales`."""
    lead, (row_tiles, col_tiles) = tiles.shape[:-4], tiles.shape[-4:-2]
    n = len(lead)
    blocks = tiles.reshape(lead + (row_tiles, col_tiles, 32, 4, 4))
    order = tuple(range(n)) + tuple(n + a for a in (0, 3, 2, 1, 4))
    return blocks.transpose(order).reshape(lead + (row_tiles * 128, col_tiles * 4))
