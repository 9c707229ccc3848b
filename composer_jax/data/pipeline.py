"""Grain pipeline for causal-LM pretraining on a document source (a code folder, JSONL, Parquet or
ArrayRecord files: `composer_jax.data.sources`).

documents -> (optionally one shard of them) -> shuffle (reseeded every epoch) -> repeat -> tokenize lazily
[bos] + tokens + [eos] (the run's tokenizer) -> cut into chunks of at most seq_len -> first-fit pack into rows of seq_len
-> batch. Rows carry `segment_ids` / `positions` so attention and next-token targets stay inside
one document piece; a chunk of a long document is its own segment with positions from 0.
Everything runs in this process (file reads on a few prefetch threads), and the iterator state is
a small dict of counters, so a run resumes at the exact row it stopped at.
"""

import base64
import json
from typing import Any

import grain
import numpy as np

# Rows packed before a packed group is emitted in shuffled order: larger mixes more files into
# each batch; the cost is that a resumed iterator re-packs at most this many rows.
DEFAULT_PACKING_BINS = 256
_PREFETCH_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=64)


class _TokenizeDocument(grain.transforms.Map):
    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def map(self, text: str) -> np.ndarray:
        ids = self._tokenizer.encode(text, add_bos=True, add_eos=True, special=False)
        return np.asarray(ids, np.int32)


class _SplitIntoChunks(grain.experimental.FlatMapTransform):
    """Cuts a document into consecutive pieces of at most seq_len tokens so every piece packs."""

    def __init__(self, seq_len: int):
        self._seq_len = seq_len

    def flat_map(self, tokens: np.ndarray) -> list[dict[str, np.ndarray]]:
        return [
            {"tokens": tokens[start : start + self._seq_len]}
            for start in range(0, len(tokens), self._seq_len)
        ]


class PackedRowFields(grain.transforms.Map):
    """Renames grain's packing outputs to int32 `tokens` / `segment_ids` / `positions`, and zeroes
    the given extra per-token fields (e.g. a loss mask) on padding; padding set here works on
    every grain version."""

    def __init__(self, pad_id: int, extra_fields: tuple[str, ...] = ()):
        self._pad_id = pad_id
        self._extra_fields = extra_fields

    def map(self, row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        segment_ids = row["tokens_segment_ids"]
        empty = segment_ids == 0
        out = {
            "tokens": np.where(empty, self._pad_id, row["tokens"]).astype(np.int32),
            "segment_ids": segment_ids.astype(np.int32),
            "positions": row["tokens_positions"].astype(np.int32),
        }
        for name in self._extra_fields:
            out[name] = np.where(empty, 0, row[name]).astype(np.int32)
        return out


def document_dataset(
    corpus,
    tokenizer,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    num_epochs: int | None = None,
) -> grain.MapDataset:
    """This process's tokenized documents, reshuffled every epoch; endless if num_epochs is None.
    `corpus`: any random-access source of texts (`CodeCorpus`, `sources.open_documents(...)`)."""
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}/{shard_count}")
    files = grain.MapDataset.source(corpus)[shard_index::shard_count]
    if len(files) == 0:
        raise ValueError(
            f"shard {shard_index}/{shard_count} of {corpus!r} is empty: more shards than files"
        )
    return files.shuffle(seed=seed).repeat(num_epochs).map(_TokenizeDocument(tokenizer))


def make_pretrain_dataset(
    corpus,
    tokenizer,
    seq_len: int,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    num_epochs: int | None = None,
    *,
    num_packing_bins: int = DEFAULT_PACKING_BINS,
) -> grain.IterDataset:
    """Batches of packed rows: dicts of int32 [batch_size, seq_len] `tokens` (pad_id where
    empty), `segment_ids` (1, 2, ... per document piece in a row, 0 for padding) and `positions`
    (from 0 within each piece, 0 for padding). A final partial batch is dropped so shapes never
    change.
    """
    if seq_len < 2 or batch_size < 1 or num_packing_bins < 1:
        raise ValueError(
            f"need seq_len >= 2, batch_size >= 1, num_packing_bins >= 1; got {seq_len=}, "
            f"{batch_size=}, {num_packing_bins=}"
        )
    documents = document_dataset(corpus, tokenizer, seed, shard_index, shard_count, num_epochs)
    chunks = grain.experimental.FlatMapIterDataset(
        documents.to_iter_dataset(_PREFETCH_OPTIONS), _SplitIntoChunks(seq_len)
    )
    rows = grain.experimental.FirstFitPackIterDataset(
        chunks,
        length_struct={"tokens": seq_len},
        num_packing_bins=num_packing_bins,
        seed=seed,
    )
    return rows.map(PackedRowFields(tokenizer.pad_id)).batch(batch_size, drop_remainder=True)


def make_pretrain_iterator(
    corpus,
    tokenizer,
    seq_len: int,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    num_epochs: int | None = None,
    *,
    num_packing_bins: int = DEFAULT_PACKING_BINS,
) -> grain.DatasetIterator:
    """`iter(make_pretrain_dataset(...))`; checkpoint it with `iterator_state_to_json`."""
    dataset = make_pretrain_dataset(
        corpus,
        tokenizer,
        seq_len,
        batch_size,
        seed,
        shard_index,
        shard_count,
        num_epochs,
        num_packing_bins=num_packing_bins,
    )
    return iter(dataset)


def _to_jsonable(value: Any) -> Any:
    """Tags what JSON lacks (bytes, tuples, numpy scalars) so `_from_jsonable` restores it."""
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise TypeError(f"iterator state has a non-string key: {list(value)}")
        return {key: _to_jsonable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_jsonable(item) for item in value]
    if isinstance(value, tuple):
        return {"__tuple__": [_to_jsonable(item) for item in value]}
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode("ascii")}
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot serialise iterator state value of type {type(value).__name__}")


def _from_jsonable(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_jsonable(item) for item in value]
    if isinstance(value, dict):
        if value.keys() == {"__tuple__"}:
            return tuple(_from_jsonable(item) for item in value["__tuple__"])
        if value.keys() == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        return {key: _from_jsonable(item) for key, item in value.items()}
    return value


def iterator_state_to_json(iterator: grain.DatasetIterator) -> str:
    """The iterator's exact position as a JSON string, for storing next to a checkpoint."""
    return json.dumps(_to_jsonable(iterator.get_state()), sort_keys=True)


def restore_iterator_from_json(iterator: grain.DatasetIterator, state_json: str) -> None:
    """Moves an iterator built with the same arguments to the position saved in `state_json`."""
    iterator.set_state(_from_jsonable(json.loads(state_json)))
