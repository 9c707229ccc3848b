"""How weights are written: bf16 words per addressable shard, XOR or zigzag-add deltas grouped by
exponent with sparse positions and 2-bit values, snapshots as byte planes, zstd; keys and CRCs of
the store layout."""

from __future__ import annotations

import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def blob_key(version: int, process: int, ordinal: int) -> str:
    return f"blobs/{version:012d}/{process:05d}/{ordinal:06d}.zst"


def manifest_key(version: int, process: int, count: int) -> str:
    return f"manifests/{version:012d}/{process:05d}-of-{count:05d}.json"


def crc(words: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(words).view(np.uint8))


def zigzag(delta: np.ndarray) -> np.ndarray:
    """Signed 16-bit deltas -> 0, 1, 2, ... for 0, -1, +1, ...: small either way."""
    signed = delta.view(np.int16)  # 16-bit arithmetic wraps: no wider copies
    return ((signed << 1) ^ (signed >> 15)).view(np.uint16)


def unzigzag(stored: np.ndarray) -> np.ndarray:
    return (stored >> 1) ^ (np.uint16(0) - (stored & 1))


def encode_words(words: np.ndarray, base: np.ndarray | None, mode: str) -> np.ndarray:
    """The uint16 words to store: the words themselves (snapshot) or their delta to `base`."""
    if base is None:
        return words
    return words ^ base if mode == "xor" else zigzag(words - base)  # uint16 arithmetic wraps


def decode_words(stored: np.ndarray, base: np.ndarray | None, mode: str) -> np.ndarray:
    if base is None:
        return stored
    return stored ^ base if mode == "xor" else base + unzigzag(stored)


def to_planes(words: np.ndarray) -> bytes:
    """High bytes then low bytes: the high plane of a small delta is nearly constant."""
    return words.view(np.uint8).reshape(-1, 2)[:, ::-1].T.tobytes()


def from_planes(data: bytes, size: int) -> np.ndarray:
    planes = np.frombuffer(data, np.uint8, count=2 * size).reshape(2, size)
    return planes[::-1].T.copy().view(np.uint16).ravel()


# Format 2: delta words grouped by their base's exponent, changed positions as a bitmap (dense
# groups) or gaps (sparse ones), changed values as 2-bit codes. Format 1 (4-bit codes in tensor
# order) is refused by readers of format 2.
FORMAT = 2
_DENSE = 0.15  # the bitmap covers the groups up to the last one with more changes than this
_ESCAPE = 3
_SKIP = 255
_HEADER = np.dtype("<u8")


def _exponents(base: np.ndarray) -> np.ndarray:
    return ((base >> 7) & 0xFF).astype(np.uint8)


def _order(exps: np.ndarray) -> np.ndarray:
    """Positions grouped by their base word's exponent (stable; a radix sort of bytes).

    A word moves when its update crosses a bf16 rounding boundary, so its chance to change is
    about |update| / ulp: nearly constant within an exponent and very different across them.
    Grouped, every stretch of the stream has one density and zstd's block-wise Huffman tables
    adapt to it; the reader knows `base`, so the order costs no bytes.
    """
    return np.argsort(exps, kind="stable")


def _gap_codes(positions: np.ndarray) -> np.ndarray:
    """One byte per changed word: the unchanged words before it; 255 = 255 of them, no change."""
    gaps = np.diff(positions, prepend=-1) - 1
    skips = gaps // _SKIP
    codes = np.full(int(gaps.size + skips.sum()), _SKIP, np.uint8)
    codes[np.cumsum(skips + 1) - 1] = gaps % _SKIP
    return codes


def _gap_positions(codes: np.ndarray) -> np.ndarray:
    c = codes.astype(np.int64)
    ends = c != _SKIP
    return np.cumsum(np.where(ends, c + 1, _SKIP))[ends] - 1


def _pack_values(values: np.ndarray) -> bytes:
    """2-bit codes, four per byte (3 = escape, its word follows in byte planes).

    Minus one, a changed word of a small step is 0 or 1 nearly always (add: the sign of a
    one-ulp move), which four-per-byte codes let zstd's Huffman stage code at about 1 bit each.
    """
    codes = np.minimum(values, _ESCAPE).astype(np.uint8)
    codes = np.append(codes, np.zeros(-codes.size % 4, np.uint8))
    packed = codes[0::4] | (codes[1::4] << 2) | (codes[2::4] << 4) | (codes[3::4] << 6)
    return packed.tobytes() + to_planes(values[values >= _ESCAPE])


def _unpack_values(data: memoryview, count: int) -> np.ndarray:
    nbytes = (count + 3) // 4
    if len(data) < nbytes:
        raise ValueError(f"delta payload ends inside its value codes ({len(data)} < {nbytes})")
    packed = np.frombuffer(data, np.uint8, count=nbytes)
    codes = np.empty((nbytes, 4), np.uint16)
    for i in range(4):
        codes[:, i] = (packed >> (2 * i)) & 3
    codes = codes.ravel()[:count]
    escaped = codes == _ESCAPE
    if len(data) != nbytes + 2 * int(escaped.sum()):
        raise ValueError(
            f"delta payload holds {len(data) - nbytes} escape bytes for {escaped.sum()} escapes"
        )
    codes[escaped] = from_planes(data[nbytes:], int(escaped.sum()))
    return codes


def pack_delta(stored: np.ndarray, base: np.ndarray) -> bytes:
    """Delta words (0 = unchanged) against `base` as one payload, in exponent order.

    Layout: two little-endian uint64 (`split`, number of gap codes); a bitmap of which of the
    first `split` words changed (the exponent groups up to the last dense one: small exponents
    move most); gap codes for the rest (one byte per change beats a mostly-zero bitmap); the
    changed words minus one as `_pack_values`. Measured variants: experiments/RESULTS.md.
    """
    exps = _exponents(base)
    order = _order(exps)
    exps, ordered = exps[order], stored[order]
    moved = ordered != 0
    ends = np.append(np.searchsorted(exps, np.arange(1, 256, dtype=np.uint8)), exps.size)
    changed = np.bincount(exps[moved], minlength=256)
    dense = np.flatnonzero(changed > _DENSE * np.diff(ends, prepend=0))
    split = int(ends[dense[-1]]) if dense.size else 0
    gaps = _gap_codes(np.flatnonzero(moved[split:]))
    header = np.array([split, gaps.size], _HEADER).tobytes()
    bitmap = np.packbits(moved[:split]).tobytes()
    return header + bitmap + gaps.tobytes() + _pack_values(ordered[moved] - np.uint16(1))


def unpack_delta(data: bytes, base: np.ndarray) -> np.ndarray:
    """The delta words `pack_delta` wrote against `base`; ValueError if `data` is malformed."""
    view, size = memoryview(data), base.size
    if len(view) < 2 * _HEADER.itemsize:
        raise ValueError(f"delta payload of {len(view)} bytes has no header")
    split, ngaps = (int(x) for x in np.frombuffer(view, _HEADER, count=2))
    nbits = (split + 7) // 8
    start = 2 * _HEADER.itemsize
    if split > size or start + nbits + ngaps > len(view):
        raise ValueError(f"delta header ({split}, {ngaps}) does not fit {size} words")
    bitmap = np.frombuffer(view, np.uint8, count=nbits, offset=start)
    gaps = np.frombuffer(view, np.uint8, count=ngaps, offset=start + nbits)
    dense = np.flatnonzero(np.unpackbits(bitmap, count=split))
    moved = np.concatenate([dense, split + _gap_positions(gaps)])
    if moved.size and moved[-1] >= size:
        raise ValueError(f"delta gap codes run past the tensor's {size} words")
    values = _unpack_values(view[start + nbits + ngaps :], moved.size) + np.uint16(1)
    stored = np.zeros(size, np.uint16)
    stored[_order(_exponents(base))[moved]] = values
    return stored


def index_slices(index: tuple, shape: tuple[int, ...]) -> list[list[int]]:
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape)]


def local_shards(tree: Any) -> list[tuple[str, str, list[list[int]], tuple, Any]]:
    """(shard key, leaf path, [[start, stop]...], global shape, data) for each shard to publish.

    Only addressable shards with replica id 0 are taken: on several processes every shard is
    published by exactly one of them.
    """
    shards = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path)
        if isinstance(leaf, jax.Array):
            items = [
                (index_slices(s.index, leaf.shape), s.data)
                for s in leaf.addressable_shards
                if s.replica_id == 0
            ]
        else:
            leaf = np.asarray(leaf)
            items = [([[0, n] for n in leaf.shape], leaf)]
        for index, data in items:
            key = f"{name}#{','.join(f'{a}:{b}' for a, b in index)}"
            shards.append((key, name, index, tuple(leaf.shape), data))
    return shards


@jax.jit
def cast_bf16(tree):
    """Fresh bf16 buffers (a copy if already bf16), never aliasing donatable train state."""
    return jax.tree.map(
        lambda x: jnp.copy(x) if x.dtype == jnp.bfloat16 else x.astype(jnp.bfloat16), tree
    )


def check_float(tree: Any) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            raise TypeError(
                f"weight sync publishes float leaves only: {jax.tree_util.keystr(path)}"
            )
