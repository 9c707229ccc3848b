"""Pretraining document sources beyond a folder of code: JSONL, Parquet and ArrayRecord files.

Each is a grain random-access data source (`len` and `[i] -> str`), so the pretraining pipeline
shards, shuffles and checkpoints it exactly like `CodeCorpus`:
- JSONL: one JSON object per line, the document in `text_field`; lines are indexed by byte offset
  once, then read with a seek.
- Parquet: the `text_field` column, read one row group at a time (a few recent groups cached).
- ArrayRecord: one document per record, UTF-8 text, or a JSON object holding `text_field`.
The held-out split is by a hash of (file name, document number), stable across machines.
`open_documents` picks the source from the path: a file, a folder of such files, or a folder of
source code (`CodeCorpus`).
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import threading
from collections.abc import Sequence

import numpy as np

from composer_jax.data.corpus import SPLITS, CodeCorpus, in_eval_split

JSONL_EXTENSIONS = (".jsonl",)
PARQUET_EXTENSIONS = (".parquet",)
ARRAY_RECORD_EXTENSIONS = (".arrayrecord", ".array_record")
DOCUMENT_EXTENSIONS = JSONL_EXTENSIONS + PARQUET_EXTENSIONS + ARRAY_RECORD_EXTENSIONS


def _split_rows(
    names: list[str], counts: list[int], split: str, eval_fraction: float
) -> np.ndarray:
    """Global row numbers of `split` over files with `counts` documents each."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    total = int(sum(counts))
    if split == "all":
        return np.arange(total, dtype=np.int64)
    keep, first = [], 0
    for name, count in zip(names, counts):
        for row in range(count):
            if in_eval_split(f"{name}:{row}", eval_fraction) == (split == "eval"):
                keep.append(first + row)
        first += count
    return np.asarray(keep, np.int64)


class _Documents:
    """Rows of several files behind one index; subclasses read one row of one file."""

    kind = "documents"

    def __init__(self, paths: Sequence[str], text_field: str, split: str, eval_fraction: float):
        if not paths:
            raise ValueError(f"no {self.kind} files given")
        self.paths = [os.fspath(p) for p in paths]
        self.text_field = text_field
        self.split = split
        counts = [self._count(p) for p in self.paths]
        self._starts = np.cumsum([0, *counts]).tolist()
        names = [os.path.basename(p) for p in self.paths]
        self._rows = _split_rows(names, counts, split, eval_fraction)
        if len(self._rows) == 0:
            raise ValueError(
                f"no documents in {self.paths[:3]} for split {split!r} (eval_fraction="
                f"{eval_fraction})"
            )

    def _count(self, path: str) -> int:
        raise NotImplementedError

    def _read(self, file_index: int, row: int) -> str:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> str:
        row = int(self._rows[index])
        file_index = bisect.bisect_right(self._starts, row) - 1
        return self._read(file_index, row - self._starts[file_index])

    def _field(self, record: dict, where: str) -> str:
        if not isinstance(record, dict) or self.text_field not in record:
            raise KeyError(f"{where}: no field {self.text_field!r} (set data.text_field)")
        value = record[self.text_field]
        if not isinstance(value, str):
            raise TypeError(f"{where}: field {self.text_field!r} is {type(value).__name__}")
        return value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.paths)} files, split={self.split!r}, docs={len(self)})"


class JsonlDocuments(_Documents):
    kind = "JSONL"

    def __init__(self, *args, **kwargs):
        self._offsets: list[np.ndarray] = []  # byte offset of every document line, per file
        super().__init__(*args, **kwargs)

    def _count(self, path):
        offsets, position = [], 0
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    offsets.append(position)
                position += len(line)
        self._offsets.append(np.asarray(offsets, np.int64))
        return len(offsets)

    def _read(self, file_index, row):
        path = self.paths[file_index]
        with open(path, "rb") as f:
            f.seek(int(self._offsets[file_index][row]))
            line = f.readline()
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: document {row} is not JSON ({e})") from None
        return self._field(record, f"{path} document {row}")


def _parquet():
    """pyarrow's Parquet module, imported on first use: only Parquet documents need it (the
    `parquet` extra), so a missing pyarrow is an error that names the extra."""
    try:
        import pyarrow.parquet
    except ImportError:
        raise ValueError(
            "Parquet documents need pyarrow: pip install 'composer-jax[parquet]'"
        ) from None
    return pyarrow.parquet


class ParquetDocuments(_Documents):
    kind = "Parquet"
    CACHED_GROUPS = 4

    def __init__(self, *args, **kwargs):
        self._group_starts: list[np.ndarray] = []  # first row of every row group, per file
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()  # grain reads from several threads
        super().__init__(*args, **kwargs)

    def _count(self, path):
        parquet = _parquet().ParquetFile(path)
        if self.text_field not in parquet.schema_arrow.names:
            raise KeyError(f"{path}: no column {self.text_field!r} (set data.text_field)")
        meta = parquet.metadata
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        self._group_starts.append(np.cumsum([0, *sizes]))
        return int(sum(sizes))

    def _group(self, file_index: int, group: int) -> list:
        key = (file_index, group)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        parquet = _parquet().ParquetFile(self.paths[file_index])
        texts = parquet.read_row_group(group, columns=[self.text_field]).column(0).to_pylist()
        with self._lock:
            self._cache[key] = texts
            while len(self._cache) > self.CACHED_GROUPS:
                self._cache.popitem(last=False)
        return texts

    def _read(self, file_index, row):
        starts = self._group_starts[file_index]
        group = int(np.searchsorted(starts, row, side="right") - 1)
        text = self._group(file_index, group)[row - int(starts[group])]
        if not isinstance(text, str):
            raise TypeError(f"{self.paths[file_index]} row {row}: {self.text_field!r} is not text")
        return text


class ArrayRecordDocuments(_Documents):
    kind = "ArrayRecord"

    def __init__(self, *args, **kwargs):
        self._sources: list = []
        super().__init__(*args, **kwargs)

    def _count(self, path):
        import grain

        source = grain.sources.ArrayRecordDataSource([path])
        self._sources.append(source)
        return len(source)

    def _read(self, file_index, row):
        text = self._sources[file_index][row].decode("utf-8", errors="replace")
        if text.startswith("{"):
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                return text
            if isinstance(record, dict) and self.text_field in record:
                return self._field(record, f"{self.paths[file_index]} record {row}")
        return text


_BY_EXTENSION = (
    (JSONL_EXTENSIONS, JsonlDocuments),
    (PARQUET_EXTENSIONS, ParquetDocuments),
    (ARRAY_RECORD_EXTENSIONS, ArrayRecordDocuments),
)


def open_documents(
    root: str,
    split: str = "all",
    *,
    text_field: str = "text",
    eval_fraction: float = 0.02,
    extensions: Sequence[str] = (".py",),
):
    """The document source at `root`: a JSONL / Parquet / ArrayRecord file, a folder of files of
    one of those kinds, or else a folder of source code read as a `CodeCorpus`."""
    if os.path.isfile(root):
        files = [root]
    elif os.path.isdir(root):
        files = sorted(
            os.path.join(root, n) for n in os.listdir(root) if n.endswith(DOCUMENT_EXTENSIONS)
        )
        if not files:
            return CodeCorpus(root, extensions, split, eval_fraction)
    else:
        raise ValueError(f"data source {root!r} is neither a file nor a folder")
    for suffixes, source in _BY_EXTENSION:
        if all(f.endswith(suffixes) for f in files):
            return source(files, text_field, split, eval_fraction)
    raise ValueError(
        f"{root}: expected files ending in one of {DOCUMENT_EXTENSIONS}, all of one kind; got "
        f"{[os.path.basename(f) for f in files[:4]]}"
    )
