"""How weights are written: bf16 words per addressable shard, XOR or zigzag-add deltas packed as
4-bit codes with escapes, snapshots as byte planes, zstd; keys and CRCs of the store layout."""

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
    signed = delta.view(np.int16).astype(np.int32)
    return ((signed << 1) ^ (signed >> 15)).astype(np.uint16)


def unzigzag(stored: np.ndarray) -> np.ndarray:
    z = stored.astype(np.int32)
    return ((z >> 1) ^ -(z & 1)).astype(np.uint16)


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


_ESCAPE = 15


def pack_delta(stored: np.ndarray) -> bytes:
    """Two 4-bit codes per byte (15 = escape, its word follows in byte planes).

    After a small update nearly every delta word is < 15; packing two per byte lets zstd's
    Huffman stage code pairs, which gets closer to their entropy than one byte per word.
    """
    codes = np.minimum(stored, _ESCAPE).astype(np.uint8)
    if codes.size % 2:
        codes = np.append(codes, np.uint8(0))
    packed = codes[0::2] | (codes[1::2] << 4)
    return packed.tobytes() + to_planes(stored[stored >= _ESCAPE])


def unpack_delta(data: bytes, size: int) -> np.ndarray:
    nbytes = (size + 1) // 2
    packed = np.frombuffer(data, np.uint8, count=nbytes)
    codes = np.empty(2 * nbytes, np.uint16)
    codes[0::2], codes[1::2] = packed & 15, packed >> 4
    codes = codes[:size]
    escaped = codes == _ESCAPE
    codes[escaped] = from_planes(data[nbytes:], int(escaped.sum()))
    return codes


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
