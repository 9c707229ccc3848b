"""Work units over sorted rows: every row is stored exactly once, by a unit of its own group."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_pallas import ragged_tiles, tiling


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_m", [64, 128])
def test_units_cover_each_row_once_with_its_group(seed, block_m):
    rng = np.random.default_rng(seed)
    num_rows, num_groups = int(rng.integers(1, 700)), int(rng.integers(1, 9))
    sizes = rng.multinomial(int(rng.integers(0, num_rows + 1)), np.ones(num_groups) / num_groups)
    sizes[rng.integers(num_groups)] = 0  # an empty group
    units = np.asarray(ragged_tiles.work_units(sizes, num_rows, block_m))
    assert units.shape == (4, ragged_tiles.max_units(num_rows, num_groups, block_m))
    owner = np.repeat(np.arange(num_groups), sizes)  # group of each row inside the groups
    stored = np.zeros(num_rows, int)
    for group, block, first, end in units.T:
        if first == end:
            continue
        assert block * block_m <= first < end <= (block + 1) * block_m
        stored[first:end] += 1
        rows = np.arange(first, end)
        if group == ragged_tiles.ZERO_FILL:
            assert (rows >= sizes.sum()).all()
        else:
            assert (owner[rows] == group).all()
    np.testing.assert_array_equal(stored, 1)
    used = units[:, units[2] < units[3]]
    assert not np.isin(np.flatnonzero(sizes == 0), used[0]).any()  # empty groups: no unit


def test_hopper_tile_table():
    big_groups = tiling.hopper_tiles(rows=8192, n=2048, groups=8, out_itemsize=2)
    assert (big_groups.block_m, big_groups.block_n) == (128, 128)
    tiny_groups = tiling.hopper_tiles(rows=256, n=2048, groups=8, out_itemsize=2)
    assert (tiny_groups.block_m, tiny_groups.block_n) == (64, 256)
    assert tiling.hopper_tiles(64, 48, 1, 4).block_n == 64
    for t in (big_groups, tiny_groups):
        smem = 2 * t.stages * (t.block_m + t.block_n) * t.block_k + 2 * t.block_m * t.block_n
        assert 2 <= t.stages <= tiling.MAX_STAGES and smem <= tiling.SMEM_BYTES
    with pytest.raises(ValueError, match="registers"):
        tiling.hopper_tiles(1024, 1024, 1, 4, block_m=128, block_n=256)
    with pytest.raises(ValueError, match="block_m"):
        tiling.hopper_tiles(1024, 1024, 1, 4, block_m=32)
