"""Block sizes per shape class, chosen by the kernel wrappers (callers may override them).

Hopper, one consumer warpgroup: the float32 accumulator lives in registers, so a tile holds at
most 128 x 128 (or 64 x 256) values -- 128 registers per thread. Small experts (few rows per
group) take 64-row tiles so a group's last tile wastes less; otherwise 128-row tiles halve the
RHS traffic per FLOP. Stages fill the shared memory left after the output tile.
"""

from __future__ import annotations

import dataclasses

SMEM_BYTES = 220 * 1024  # of the 227 KiB an H100/H200 block may use, leaving room for barriers
MAX_STAGES = 4


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    stages: int


def _stages(stage_bytes: int, fixed_bytes: int, requested: int | None) -> int:
    fits = (SMEM_BYTES - fixed_bytes) // stage_bytes
    if fits < 2:
        raise ValueError(f"tiles need {2 * stage_bytes + fixed_bytes} bytes of SMEM: too large")
    return min(requested or MAX_STAGES, fits)


def hopper_tiles(
    rows: int,
    n: int,
    groups: int,
    out_itemsize: int,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    stages: int | None = None,
) -> Tiles:
    """Tiles for the bf16 grouped GEMM: [rows, K] x [groups, K, n]."""
    rows_per_group = rows / max(groups, 1)
    if block_m is None:
        block_m = 64 if rows_per_group <= 96 else 128
    if block_n is None:
        block_n = 64 if n <= 64 else (256 if block_m == 64 and n >= 256 else 128)
    block_k = block_k or 64
    if block_m % 64 or block_n % 64 or block_k % 64:
        # block_n: whole 128-byte rows, so row-exact TMA stores start on aligned SMEM addresses.
        raise ValueError("tiles need block_m % 64, block_n % 64, block_k % 64 == 0")
    if block_m * block_n > 128 * 128:
        raise ValueError(f"a {block_m} x {block_n} float32 accumulator exceeds the registers")
    stage_bytes = 2 * (block_m * block_k + block_k * block_n)
    out_bytes = out_itemsize * block_m * block_n
    return Tiles(block_m, block_n, block_k, _stages(stage_bytes, out_bytes, stages))


def hopper_wgrad_tiles(
    k: int, n: int, *, block_k=None, block_n=None, block_t=None, stages=None
) -> Tiles:
    """Tiles of the wgrad kernel: out [K, N] per group, contracting `block_t` token rows a step
    (returned as block_m = K tile, block_k = token tile)."""
    block_k = block_k or (64 if k <= 64 else 128)
    block_n = block_n or (64 if n <= 64 else 128)
    block_t = block_t or 64
    if block_k % 64 or block_n % 8 or block_t % 64:
        raise ValueError("wgrad tiles need block_k % 64, block_n % 8, block_t % 64 == 0")
    if block_k * block_n > 128 * 128:
        raise ValueError(f"a {block_k} x {block_n} float32 accumulator exceeds the registers")
    stage_bytes = 2 * block_t * (block_k + block_n)
    return Tiles(block_k, block_n, block_t, _stages(stage_bytes, 4 * block_k * block_n, stages))
