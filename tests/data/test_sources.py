"""JSONL / Parquet / ArrayRecord document sources, and the pretraining pipeline over them with a
real BPE tokenizer: every document piece once per epoch, disjoint shards, exact resumption."""

import collections
import json
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from composer_jax.data.corpus import CodeCorpus
from composer_jax.data.pipeline import (
    iterator_state_to_json,
    make_pretrain_iterator,
    restore_iterator_from_json,
)
from composer_jax.data.sources import (
    ArrayRecordDocuments,
    JsonlDocuments,
    ParquetDocuments,
    open_documents,
)
from composer_jax.data.tokenizer import load_tokenizer
from tests.data.helpers import make_hf_folder

_ALPHABET = list("abcdefghij klmnop\n\t()=:#é中😀")


def _documents(count: int) -> list[str]:
    rng = np.random.default_rng()
    return [
        f"doc {i}\n" + "".join(rng.choice(_ALPHABET, size=int(rng.integers(0, 300))))
        for i in range(count)
    ]


def _write_jsonl(path, texts, field="text"):
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, field: text}) + "\n")
            if i % 7 == 0:
                f.write("\n")  # blank lines are not documents


def _write_parquet(path, texts, field="text"):
    table = pa.table({"id": list(range(len(texts))), field: texts})
    pq.write_table(table, path, row_group_size=9)


def _write_array_record(path, texts, as_json=False):
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for text in texts:
        record = json.dumps({"text": text}) if as_json else text
        writer.write(record.encode("utf-8"))
    writer.close()


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "array_record", "array_record_json"])
def test_sources_return_every_document_in_order(tmp_path, kind):
    first, second = _documents(23), _documents(17)
    if kind == "jsonl":
        paths = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
        _write_jsonl(paths[0], first), _write_jsonl(paths[1], second)
        source = JsonlDocuments(paths, "text", "all", 0.1)
    elif kind == "parquet":
        paths = [tmp_path / "a.parquet", tmp_path / "b.parquet"]
        _write_parquet(paths[0], first), _write_parquet(paths[1], second)
        source = ParquetDocuments(paths, "text", "all", 0.1)
    else:
        paths = [tmp_path / "a.arrayrecord", tmp_path / "b.arrayrecord"]
        as_json = kind == "array_record_json"
        (
            _write_array_record(paths[0], first, as_json),
            _write_array_record(paths[1], second, as_json),
        )
        source = ArrayRecordDocuments(paths, "text", "all", 0.1)
    assert len(source) == 40
    order = np.random.default_rng().permutation(40)  # random access, as grain reads
    got = {int(i): source[int(i)] for i in order}
    assert [got[i] for i in range(40)] == first + second
    train = type(source)(paths, "text", "train", 0.3)
    held_out = type(source)(paths, "text", "eval", 0.3)
    assert sorted([*train, *held_out]) == sorted(first + second)
    assert 0 < len(held_out) < 30
    assert list(train) == list(type(source)(paths, "text", "train", 0.3))  # deterministic


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "docs.parquet"
    _write_parquet(path, ["a"])
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were missing
    with pytest.raises(ValueError, match=r"composer-jax\[parquet\]"):
        ParquetDocuments([str(path)], "text", "all", 0.1)


def test_missing_field_is_named(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", _documents(3), field="content")
    with pytest.raises(KeyError, match="no field 'text'"):
        JsonlDocuments([tmp_path / "a.jsonl"], "text", "all", 0.1)[0]
    assert JsonlDocuments([tmp_path / "a.jsonl"], "content", "all", 0.1)[0].startswith("doc 0")
    _write_parquet(tmp_path / "a.parquet", _documents(3), field="content")
    with pytest.raises(KeyError, match="no column 'text'"):
        ParquetDocuments([tmp_path / "a.parquet"], "text", "all", 0.1)


def test_open_documents_picks_the_source(tmp_path):
    (tmp_path / "j").mkdir(), (tmp_path / "code").mkdir(), (tmp_path / "mixed").mkdir()
    _write_jsonl(tmp_path / "j" / "1.jsonl", _documents(5))
    _write_jsonl(tmp_path / "j" / "2.jsonl", _documents(6))
    assert isinstance(open_documents(str(tmp_path / "j")), JsonlDocuments)
    assert len(open_documents(str(tmp_path / "j"))) == 11
    assert len(open_documents(str(tmp_path / "j" / "1.jsonl"))) == 5
    (tmp_path / "code" / "m.py").write_text("x = 1\n")
    assert isinstance(open_documents(str(tmp_path / "code")), CodeCorpus)
    _write_jsonl(tmp_path / "mixed" / "1.jsonl", _documents(2))
    _write_parquet(tmp_path / "mixed" / "2.parquet", _documents(2))
    with pytest.raises(ValueError, match="all of one kind"):
        open_documents(str(tmp_path / "mixed"))
    with pytest.raises(ValueError, match="neither a file nor a folder"):
        open_documents(str(tmp_path / "nowhere.jsonl"))


def _pieces(texts, tokenizer, seq_len):
    chunks = collections.Counter()
    for text in texts:
        tokens = tokenizer.encode(text, add_bos=True, add_eos=True)
        chunks.update(
            tuple(tokens[start : start + seq_len]) for start in range(0, len(tokens), seq_len)
        )
    return chunks


def _emitted(iterator):
    out = collections.Counter()
    for batch in iterator:
        for tokens, segment_ids in zip(batch["tokens"], batch["segment_ids"]):
            for segment in range(1, segment_ids.max() + 1):
                out[tuple(tokens[segment_ids == segment])] += 1
    return out


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "array_record"])
def test_pipeline_over_documents_with_a_bpe_tokenizer(tmp_path, kind):
    make_hf_folder(tmp_path / "tok")
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    texts = _documents(30)
    path = (
        tmp_path
        / {"jsonl": "d.jsonl", "parquet": "d.parquet", "array_record": "d.arrayrecord"}[kind]
    )
    {"jsonl": _write_jsonl, "parquet": _write_parquet, "array_record": _write_array_record}[kind](
        path, texts
    )
    source = open_documents(str(path))
    seq_len = 24
    one_epoch = make_pretrain_iterator(source, tokenizer, seq_len, 1, seed=1, num_epochs=1)
    assert _emitted(one_epoch) == _pieces(texts, tokenizer, seq_len)
    shards = [
        _emitted(
            make_pretrain_iterator(
                source, tokenizer, seq_len, 1, seed=1, shard_index=i, shard_count=2, num_epochs=1
            )
        )
        for i in range(2)
    ]
    assert shards[0] + shards[1] == _pieces(texts, tokenizer, seq_len)
    assert shards[0] == _pieces(texts[0::2], tokenizer, seq_len)

    def fresh():
        return make_pretrain_iterator(source, tokenizer, seq_len, batch_size=2, seed=4)

    iterator = fresh()
    for _ in range(int(np.random.default_rng().integers(1, 25))):
        next(iterator)
    state = iterator_state_to_json(iterator)
    want = [next(iterator) for _ in range(6)]
    resumed = fresh()
    restore_iterator_from_json(resumed, state)
    for expected in want:
        got = next(resumed)
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name])
