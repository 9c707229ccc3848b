"""Streaming reads of Hugging Face DeepSeek-V3-format checkpoints: any slice of any tensor,
without reading the rest.

`CheckpointReader` indexes a folder (local or a bucket, through epath) from the safetensors
headers alone. `hf_sources` turns its tensors into lazy `Source`s under HF's names, fp8 block
weights dequantized and fused experts split on read, and the weight mapping composes them
(`Transposed`, `SplitAxis`, `Stacked`) into the model's parameters without touching data.
`Source.read(index, dtype)` then reads exactly the region a device holds, in strips of at most
`buffer_bytes`, so a 1T checkpoint loads with host memory of about one tensor slice. The eager
reader in `safetensors_io` is the reference these reads are tested against.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Iterator
from typing import Protocol

import numpy as np
from etils import epath

from composer_jax.interop.safetensors_io import (
    DEFAULT_FP8_BLOCK,
    FP8_DTYPES,
    INDEX_FILE,
    SCALE_SUFFIX,
    TensorEntry,
    dequantize_fp8_blocks,
    read_header,
    read_hf_config,
)

Index = tuple[slice, ...]
DEFAULT_BUFFER_BYTES = 64 << 20
_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_FLOAT_KINDS = ("f", "V")  # ml_dtypes' bfloat16 and float8 types have kind "V"


class CheckpointReadError(ValueError):
    """A checkpoint's files do not hold what their headers or index say; names tensor and file."""


def full_index(shape: tuple[int, ...]) -> Index:
    return tuple(slice(0, n) for n in shape)


def normalize(index: Index, shape: tuple[int, ...]) -> Index:
    """`index` with explicit starts and stops (JAX gives `slice(None)` for unsharded dims)."""
    out = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided reads are not supported: {s}")
        out.append(slice(start, stop))
    return tuple(out)


def _extent(index: Index) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in index)


class CheckpointReader:
    """A checkpoint folder indexed from its headers; reads byte ranges of its shards on demand.

    Open files are kept until `close()` (or the end of a `with` block); `bytes_read` counts the
    tensor bytes read so far (headers aside; locally the regions copied, from a bucket the
    strips fetched)."""

    def __init__(self, path, buffer_bytes: int = DEFAULT_BUFFER_BYTES):
        self.folder = epath.Path(path)
        self._local = "://" not in os.fspath(path)
        self.buffer_bytes = buffer_bytes
        self.bytes_read = 0
        self._files: dict[str, object] = {}
        self.config = read_hf_config(self.folder)
        self.entries = self._index()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _open(self, file: str):
        if file not in self._files:
            path = self.folder / file
            if not path.exists():
                raise CheckpointReadError(f"{self.folder}: shard {file} is missing")
            self._files[file] = path.open("rb")
        return self._files[file]

    def _index(self) -> dict[str, TensorEntry]:
        index_path = self.folder / INDEX_FILE
        weight_map = json.loads(index_path.read_text())["weight_map"] if index_path.exists() else {}
        files = sorted(set(weight_map.values())) or sorted(
            p.name for p in self.folder.glob("*.safetensors")
        )
        if not files:
            raise FileNotFoundError(f"{self.folder}: no *.safetensors files")
        entries: dict[str, TensorEntry] = {}
        for file in files:
            f = self._open(file)
            size = f.seek(0, 2)
            f.seek(0)
            for name, entry in read_header(f, file, size).items():
                if name in entries:
                    raise CheckpointReadError(
                        f"tensor {name!r} is in both {entries[name].file} and {file}"
                    )
                entries[name] = entry
        for name, file in weight_map.items():
            if name not in entries or entries[name].file != file:
                found = entries[name].file if name in entries else "no shard"
                raise CheckpointReadError(
                    f"{INDEX_FILE} puts tensor {name!r} in {file}, found in {found}"
                )
        return entries

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def read(self, name: str, index: Index, dtype) -> np.ndarray:
        """Region `index` of tensor `name` as `dtype`, a strip of leading-axis rows (at most
        `buffer_bytes`, one row at least) at a time. A local strip is memory-mapped only while it
        is copied, so only the region's pages are read (a column slice skips the other columns)
        and none stay resident; a bucket's strip is read whole."""
        entry = self.entries[name]
        if not entry.shape:
            return self._bytes(entry, entry.start, entry.nbytes).view(entry.dtype).astype(dtype)
        index = normalize(index, entry.shape)
        out = np.empty(_extent(index), dtype)
        row_bytes = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
        rows_per_strip = max(1, self.buffer_bytes // max(row_bytes, 1))
        first, last = index[0].start, index[0].stop
        for lo in range(first, last, rows_per_strip):
            hi = min(lo + rows_per_strip, last)
            strip = self._strip(entry, lo, hi, row_bytes)
            out[lo - first : hi - first] = strip[(slice(None), *index[1:])]
            if self._local:
                self.bytes_read += out[lo - first : hi - first].size * entry.dtype.itemsize
        return out

    def _strip(self, entry: TensorEntry, lo: int, hi: int, row_bytes: int) -> np.ndarray:
        """Rows [lo, hi) of a tensor, as stored."""
        shape = (hi - lo, *entry.shape[1:])
        start = entry.start + lo * row_bytes
        if self._local:
            return np.memmap(self.folder / entry.file, entry.dtype, "r", start, shape)
        return self._bytes(entry, start, (hi - lo) * row_bytes).view(entry.dtype).reshape(shape)

    def _bytes(self, entry: TensorEntry, start: int, length: int) -> np.ndarray:
        f = self._open(entry.file)
        f.seek(start)
        data = f.read(length)
        if len(data) != length:
            raise CheckpointReadError(
                f"{entry.file}: tensor {entry.name!r} ends past the end of the file (truncated shard)"
            )
        self.bytes_read += length
        return np.frombuffer(data, np.uint8)


class Source(Protocol):
    """A lazily read array: its shape, and any contiguous region of it in a chosen dtype."""

    shape: tuple[int, ...]

    def read(self, index: Index, dtype) -> np.ndarray: ...


@dataclasses.dataclass
class Stored:
    """A tensor as stored in the checkpoint."""

    reader: CheckpointReader
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.reader.entries[self.name].shape

    def read(self, index: Index, dtype) -> np.ndarray:
        return self.reader.read(self.name, index, dtype)


@dataclasses.dataclass
class ArraySource:
    """An array already in memory (a tensor dict built by hand, or read eagerly)."""

    array: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def read(self, index: Index, dtype) -> np.ndarray:
        return np.asarray(self.array[normalize(index, self.shape)], dtype)


@dataclasses.dataclass
class Dequantized:
    """A DeepSeek-V3 fp8 block weight: each region is dequantized from the blocks that cover it
    (`dequantize_fp8_blocks`, the reference), a strip of block rows at a time."""

    weight: Stored
    scale_inv: Stored
    block: tuple[int, int] = DEFAULT_FP8_BLOCK

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape

    def read(self, index: Index, dtype) -> np.ndarray:
        (rows, cols), (b0, b1) = normalize(index, self.shape), self.block
        row_lo, col_lo = rows.start // b0 * b0, cols.start // b1 * b1
        col_hi = min(-(-cols.stop // b1) * b1, self.shape[1])
        out = np.empty(_extent((rows, cols)), dtype)
        row_bytes = (col_hi - col_lo) * 4
        strip = max(1, self.weight.reader.buffer_bytes // max(row_bytes * b0, 1)) * b0
        for lo in range(row_lo, rows.stop, strip):
            hi = min(lo + strip, -(-rows.stop // b0) * b0, self.shape[0])
            fp8 = self.weight.read((slice(lo, hi), slice(col_lo, col_hi)), self.weight_dtype)
            scales = self.scale_inv.read(
                (slice(lo // b0, -(-hi // b0)), slice(col_lo // b1, -(-col_hi // b1))), np.float32
            )
            block = dequantize_fp8_blocks(fp8, scales, self.block, name=self.weight.name)
            take_lo, take_hi = max(lo, rows.start), min(hi, rows.stop)
            out[take_lo - rows.start : take_hi - rows.start] = block[
                take_lo - lo : take_hi - lo, cols.start - col_lo : cols.stop - col_lo
            ]
        return out

    @property
    def weight_dtype(self) -> np.dtype:
        return self.weight.reader.entries[self.weight.name].dtype


@dataclasses.dataclass
class Part:
    """Rows [start, stop) of entry `lead` of a 3-D tensor: one expert of a fused expert tensor."""

    base: Source
    lead: int
    start: int
    stop: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.stop - self.start, *self.base.shape[2:])

    def read(self, index: Index, dtype) -> np.ndarray:
        rows, *rest = normalize(index, self.shape)
        shifted = slice(self.start + rows.start, self.start + rows.stop)
        return self.base.read((slice(self.lead, self.lead + 1), shifted, *rest), dtype)[0]


@dataclasses.dataclass
class Transposed:
    """A 2-D source transposed: HF linears are [out, in], the model's [in, out]."""

    base: Source

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape[::-1]

    def read(self, index: Index, dtype) -> np.ndarray:
        return self.base.read(normalize(index, self.shape)[::-1], dtype).T


@dataclasses.dataclass
class SplitAxis:
    """`base` with axis `axis` split into `parts` (one of them may be -1), like a reshape."""

    base: Source
    axis: int
    parts: tuple[int, ...]

    def __post_init__(self):
        n = self.base.shape[self.axis]
        known = math.prod(p for p in self.parts if p != -1)
        self.parts = tuple(n // known if p == -1 else p for p in self.parts)
        if math.prod(self.parts) != n:
            raise ValueError(f"cannot split an axis of {n} into {self.parts}")

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.base.shape
        return (*s[: self.axis], *self.parts, *s[self.axis + 1 :])

    def read(self, index: Index, dtype) -> np.ndarray:
        """Reads whole rows of the split's leading part, then takes the inner parts' slices."""
        index = normalize(index, self.shape)
        a, k = self.axis, len(self.parts)
        lead, inner = index[a], math.prod(self.parts[1:])
        base_index = (*index[:a], slice(lead.start * inner, lead.stop * inner), *index[a + k :])
        block = self.base.read(base_index, dtype)
        block = block.reshape(
            (*block.shape[:a], lead.stop - lead.start, *self.parts[1:], *block.shape[a + 1 :])
        )
        return block[(slice(None),) * (a + 1) + index[a + 1 : a + k]]


@dataclasses.dataclass
class Stacked:
    """Sources of one shape stacked on a new leading axis (layers, experts)."""

    parts: list

    def __post_init__(self):
        shapes = {p.shape for p in self.parts}
        if len(shapes) != 1:
            raise ValueError(f"stacked tensors differ in shape: {sorted(shapes)}")

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.parts), *self.parts[0].shape)

    def read(self, index: Index, dtype) -> np.ndarray:
        index = normalize(index, self.shape)
        out = np.empty(_extent(index), dtype)
        for offset, source, sub in pieces(self, index):
            out[offset] = source.read(sub, dtype)
        return out


def pieces(source: Source, index: Index) -> Iterator[tuple[tuple[int, ...], Source, Index]]:
    """`source[index]` as unstacked pieces: (position in the region, source, its index). A device
    shard is filled piece by piece, so host memory never holds more than one piece."""
    index = normalize(index, source.shape)
    if not isinstance(source, Stacked):
        yield (), source, index
        return
    for position, i in enumerate(range(index[0].start, index[0].stop)):
        for offset, part, sub in pieces(source.parts[i], index[1:]):
            yield (position, *offset), part, sub


def _check_block_scales(weight, scale, block: tuple[int, int]) -> None:
    """A block-scaled weight is 2-D with one inverse scale per `block` (edge blocks partial):
    a scale grid of another size would be sliced and applied to the wrong blocks."""
    if len(weight.shape) != 2:
        raise CheckpointReadError(
            f"{weight.file}: float8 tensor {weight.name!r} has shape {tuple(weight.shape)}; "
            "block-scaled weights are 2-D"
        )
    want = tuple(-(-n // b) for n, b in zip(weight.shape, block))
    if tuple(scale.shape) != want:
        raise CheckpointReadError(
            f"{weight.file}: scale {scale.name!r} has shape {tuple(scale.shape)}; "
            f"{tuple(weight.shape)} in blocks of {list(block)} (weight_block_size) needs {want}"
        )


def hf_sources(reader: CheckpointReader) -> dict[str, Source]:
    """Every tensor of the checkpoint as a lazy float source under HF's per-expert names: fp8
    weights paired with their `_scale_inv` blocks, fused experts split (the lazy counterpart of
    `safetensors_io.read_hf_checkpoint`)."""
    quant = reader.config.get("quantization_config") or {}
    block = tuple(quant.get("weight_block_size", DEFAULT_FP8_BLOCK))
    entries = reader.entries
    sources: dict[str, Source] = {}
    for name, entry in entries.items():
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in entries:
                raise CheckpointReadError(
                    f"{entry.file}: scale {name!r} has no weight {name.removesuffix(SCALE_SUFFIX)!r}"
                )
            continue
        if entry.dtype.kind not in _FLOAT_KINDS:
            raise CheckpointReadError(
                f"{entry.file}: tensor {name!r} is {entry.dtype}, not a floating-point type"
            )
        scale = entries.get(name + SCALE_SUFFIX)
        if entry.dtype in FP8_DTYPES:
            if scale is None:
                raise CheckpointReadError(
                    f"{entry.file}: tensor {name!r} is {entry.dtype} but has no "
                    f"{name + SCALE_SUFFIX!r}"
                )
            _check_block_scales(entry, scale, block)
            source = Dequantized(Stored(reader, name), Stored(reader, scale.name), block)
        elif scale is not None:
            raise CheckpointReadError(
                f"{entry.file}: tensor {name!r} is {entry.dtype} but has a block scale "
                f"{scale.name!r} (only float8 weights are block-scaled)"
            )
        else:
            source = Stored(reader, name)
        _add(sources, name, source, entry.file)
    return sources


def _add(sources: dict[str, Source], name: str, source: Source, file: str) -> None:
    """Adds one tensor, splitting a fused expert tensor ([E, 2F, D] gate_up, [E, D, F] down)
    into the per-expert names of hub checkpoints."""
    fused = _FUSED_EXPERTS.match(name)
    if not fused:
        _put(sources, name, source, file)
        return
    prefix, kind = fused.groups()
    if len(source.shape) != 3 or (kind == "gate_up_proj" and source.shape[1] % 2):
        raise CheckpointReadError(
            f"{file}: fused expert tensor {name!r} has shape {list(source.shape)}, "
            "not [E, 2F, D] (gate_up_proj) or [E, D, F] (down_proj)"
        )
    num_experts, rows = source.shape[:2]
    splits = (
        {"gate_proj": (0, rows // 2), "up_proj": (rows // 2, rows)}
        if kind == "gate_up_proj"
        else {"down_proj": (0, rows)}
    )
    for e in range(num_experts):
        for part, (lo, hi) in splits.items():
            _put(sources, f"{prefix}{e}.{part}.weight", Part(source, e, lo, hi), file)


def _put(sources: dict[str, Source], name: str, source: Source, file: str) -> None:
    if name in sources:
        raise CheckpointReadError(
            f"{file}: tensor {name!r} is given twice (fused and per-expert layouts?)"
        )
    sources[name] = source
