"""Group-aligned row layout for grouped GEMMs, and the pure-jnp reference product.

Kernels tile the token axis; a tile must not straddle two experts (nor, for token-axis scale
blocks, may a scale block). Each expert's rows are therefore moved to a start that is a multiple
of `align`, zero rows filling the gaps; rows past sum(group_sizes) are dropped.
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
