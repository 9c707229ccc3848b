"""Work units of a grouped GEMM over expert-sorted rows, and the row-exact tile store.

The LHS stays in its sorted layout (no copy to an expert-aligned layout). Cut the rows into
`block_m` tiles; a tile that straddles a group boundary is visited once per group it touches,
each visit computing the whole tile against that group's RHS and storing only that group's rows.
Rows past sum(group_sizes) form one more segment, stored as zeros without any MMA. Empty groups
produce no unit, so skewed routing wastes at most one partial tile per group boundary, and units
past the last one (the static grid is an upper bound) exit at once.

A unit is four int32s: (group, m block, first row, end row); group -1 marks a zero-fill unit and
first == end an unused slot. Used units come first, in row order, so the zero-fill units are the
last used ones: a persistent kernel looping over the first `used_units` units in order meets
every MMA unit before any zero-fill unit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ZERO_FILL = -1  # `group` of the unit that zeroes the rows past the groups


def max_units(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static bound: every tile once, plus one extra visit per boundary between segments."""
    return -(-num_rows // block_m) + num_groups


def work_units(group_sizes_G: jax.Array, num_rows: int, block_m: int) -> jax.Array:
    """int32 [4, max_units] table of (group, m block, first row, end row) per unit."""
    sizes = group_sizes_G.astype(jnp.int32)
    num_groups = sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    # The tail segment: rows past the groups.
    seg_start = jnp.concatenate([starts, ends[-1:]])
    seg_end = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])
    seg_group = jnp.concatenate(
        [jnp.arange(num_groups, dtype=jnp.int32), jnp.full((1,), ZERO_FILL, jnp.int32)]
    )
    nonempty = seg_end > seg_start
    first_block = seg_start // block_m
    last_block = (seg_end - 1) // block_m
    seg_units = jnp.where(nonempty, last_block - first_block + 1, 0)
    units_end = jnp.cumsum(seg_units)
    unit = jnp.arange(max_units(num_rows, num_groups, block_m), dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(units_end, unit, side="right"), num_groups)
    block = first_block[seg] + unit - (units_end[seg] - seg_units[seg])
    first = jnp.maximum(seg_start[seg], block * block_m)
    end = jnp.minimum(seg_end[seg], block * block_m + block_m)
    used = unit < units_end[-1]
    return jnp.stack(
        [
            jnp.where(used, seg_group[seg], ZERO_FILL),
            jnp.where(used, block, 0),
            jnp.where(used, first, 0),
            jnp.where(used, end, 0),
        ]
    ).astype(jnp.int32)


def used_units(units: jax.Array) -> jax.Array:
    """int32 [1]: how many leading units of a `work_units` table are used."""
    return jnp.sum(units[3] > units[2], dtype=jnp.int32)[None]


def read_unit(units_gmem, u, block_m: int):
    """(group, m block, first row within the tile, rows to store) of unit `u`, as scalars."""
    group, block = units_gmem[0, u], units_gmem[1, u]
    first, end = units_gmem[2, u], units_gmem[3, u]
    return group, block, first - block * block_m, end - first


def cta_rows(first, count, cta, rows_per_cta: int):
    """(first, end) of a unit's rows [first, first + count) within CTA `cta`'s slice of the tile,
    relative to that slice, when consecutive CTAs own consecutive `rows_per_cta` rows."""
    offset = cta * rows_per_cta
    lo = jnp.clip(first - offset, 0, rows_per_cta)
    return lo, jnp.clip(first + count - offset, lo, rows_per_cta)


def store_rows(
    tile_smem, out_gmem, tile_row0, first, count, max_rows: int, n_slice, *, commit_group=True
) -> None:
    """Copies tile rows [first, first + count) to out rows tile_row0 + [first, first + count).

    TMA copies have static shapes, so the count is decomposed into powers of two (at most
    log2(max_rows) + 1 copies), each issued only when its bit is set. The caller commits SMEM
    before and waits for the copies after; with `commit_group=False` the caller also commits the
    copies as one bulk group (so one wait covers a whole tile whatever its row count).
    """
    start = first
    size = 1 << (max_rows.bit_length() - 1)
    while size:

        @pl.when(count & size != 0)
        def _(start=start, size=size):
            plgpu.copy_smem_to_gmem(
                tile_smem.at[pl.ds(start, size)],
                out_gmem.at[pl.ds(tile_row0 + start, size), n_slice],
                commit_group=commit_group,
            )

        start = start + (count & size)
        size //= 2
