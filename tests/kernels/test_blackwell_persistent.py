"""Persistent Blackwell grouped GEMM: lowers for CUDA on CPU; its schedule, simulated on the host.

Numerics need Blackwell hardware (the GPU check runs them against the reference on a B200). What
the CPU can check: every variant lowers (Mosaic GPU's own checks run then: TMEM columns, 2-CTA
MMA shapes, scale layouts), and the persistent schedule -- CTAs striding over (unit, N tile),
the accumulator half and ring slot taken from the CTA's local tile count, each CTA of a pair
storing its half of a unit's rows -- stores every output row once, from its own group.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import blackwell_persistent as persistent
from kernels_pallas import ragged_tiles
from tests.kernels import lowered_mosaic
from tests.kernels.test_blackwell_grouped_gemm import FORMATS, _specs


def _lower(fn, *specs):
    return jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))


def _kernel_count(fn, *specs) -> int:
    return len(lowered_mosaic.kernel_modules(_lower(fn, *specs)))


@pytest.mark.parametrize("collective", [False, True])
def test_lowers_for_cuda_with_fused_factors(collective):
    """Ragged groups (the wrapper's units cover empty and tiny groups), bf16 output, factors."""
    m, k, n, g = 1000, 512, 384, 8
    factors = (jax.ShapeDtypeStruct((m,), jnp.float32), jax.ShapeDtypeStruct((g, n), jnp.float32))
    kernel = functools.partial(
        persistent.grouped_gemm, out_dtype=jnp.bfloat16, collective=collective
    )
    assert _kernel_count(kernel, *_specs("nvfp4", m, k, n, g), *factors) == 1


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("collective", [False, True])
@pytest.mark.parametrize(
    "m, k, n, g, num_sms",
    [
        (300, 256, 256, 4, 148),  # more CTAs than tiles: the grid shrinks to the tile bound
        (4096, 1024, 512, 8, 16),  # many tiles per CTA
        (40, 128, 128, 6, 148),  # groups smaller than a tile, one unit shared by all
        (136, 96, 200, 3, 8),  # K and N padded to the tiles
    ],
)
def test_lowers_for_cuda_at_ragged_shapes(fmt, collective, m, k, n, g, num_sms):
    kernel = functools.partial(persistent.grouped_gemm, collective=collective, num_sms=num_sms)
    assert _kernel_count(kernel, *_specs(fmt, m, k, n, g)) == 1


def test_lowers_through_the_jax_0_11_warp_map_spelling(monkeypatch):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    monkeypatch.delattr(plgpu, "warp_map", raising=False)  # JAX 0.11 has only core_map
    assert _kernel_count(persistent.grouped_gemm, *_specs("mxfp8", 136, 128, 128, 2)) == 1


def test_tile_table_and_tmem_budget():
    fp8 = persistent.persistent_tiles(2048, jnp.float8_e4m3fn, out_itemsize=2)
    pair = persistent.persistent_tiles(2048, jnp.float8_e4m3fn, out_itemsize=2, collective=True)
    fp4 = persistent.persistent_tiles(2048, jnp.float4_e2m1fn, out_itemsize=2)
    assert (fp8.block_m, fp8.block_n, pair.block_m, pair.block_n) == (128, 128, 256, 128)
    assert (fp8.stages, pair.stages, fp4.stages) == (5, 6, 6)  # 33, 25 and 18 KB a stage
    # Two 128 x 256 float32 accumulators fill TMEM's 512 columns: no room for the scales.
    with pytest.raises(ValueError, match="TMEM columns"):
        persistent.persistent_tiles(2048, jnp.float8_e4m3fn, block_n=256)
    with pytest.raises(ValueError, match="block_n"):
        persistent.persistent_tiles(2048, jnp.float8_e4m3fn, block_n=192)


def test_invalid_inputs_are_named():
    dtype, _ = FORMATS["mxfp8"]
    lhs, lhs_sc = jnp.zeros((128, 128), dtype), jnp.zeros((128, 4), jnp.uint8)
    rhs, rhs_sc = jnp.zeros((2, 128, 128), dtype), jnp.zeros((2, 128, 4), jnp.uint8)
    sizes = jnp.array([64, 64], jnp.int32)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        persistent.grouped_gemm(lhs.astype(jnp.bfloat16), lhs_sc, rhs, rhs_sc, sizes)
    with pytest.raises(ValueError, match="scales must be"):
        persistent.grouped_gemm(lhs, lhs_sc[:, :2], rhs, rhs_sc, sizes)
    with pytest.raises(ValueError, match="num_sms"):
        persistent.grouped_gemm(lhs, lhs_sc, rhs, rhs_sc, sizes, num_sms=0)
    with pytest.raises(ValueError, match="row_scale"):
        persistent.grouped_gemm(lhs, lhs_sc, rhs, rhs_sc, sizes, jnp.ones((7,), jnp.float32))


def _nd_loop_order(total: int, num_ctas: int, cta: int) -> list[int]:
    """Flat tile indices CTA `cta` visits under `plgpu.nd_loop(..., collective_axes=...)`."""
    return list(range(cta, total, num_ctas))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("collective", [False, True])
def test_persistent_schedule_stores_every_row_once_from_its_group(seed, collective):
    rng = np.random.default_rng(seed)
    num_rows, num_groups = int(rng.integers(1, 1500)), int(rng.integers(1, 10))
    sizes = rng.multinomial(int(rng.integers(0, num_rows + 1)), np.ones(num_groups) / num_groups)
    sizes[rng.integers(num_groups)] = 0  # an empty group
    sizes[rng.integers(num_groups)] = min(3, sizes.sum())  # a tiny one
    unit_m = 256 if collective else 128
    n_tiles, num_ctas = int(rng.integers(1, 4)), int(rng.integers(1, 20))
    units = np.asarray(ragged_tiles.work_units(jnp.asarray(sizes), num_rows, unit_m))
    used = int(ragged_tiles.used_units(jnp.asarray(units))[0])
    owner = np.repeat(np.arange(num_groups), sizes)
    stored = np.zeros((num_rows, n_tiles), int)
    for cta in range(num_ctas):
        mma_tiles = 0
        for local, flat in enumerate(_nd_loop_order(used * n_tiles, num_ctas, cta)):
            u, ni = divmod(flat, n_tiles)
            group, block, first, count = (int(v) for v in ragged_tiles.read_unit(units, u, unit_m))
            if group >= 0:
                # The kernel takes the accumulator half and ring position from `local`: it must
                # count this CTA's MMA tiles before this one (zero-fill tiles come last).
                assert local == mma_tiles
                mma_tiles += 1
            for half in range(unit_m // 128):
                lo, hi = (int(v) for v in ragged_tiles.cta_rows(first, count, half, 128))
                rows = block * unit_m + half * 128 + np.arange(lo, hi)
                stored[rows, ni] += 1
                if group >= 0:
                    assert (owner[rows] == group).all()
                else:
                    assert (rows >= sizes.sum()).all()
    np.testing.assert_array_equal(stored, 1)
