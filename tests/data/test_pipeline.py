import collections
import json
import os

import numpy as np
import pytest

from composer_jax.data.corpus import CodeCorpus, default_code_root, list_source_files
from composer_jax.data.pipeline import (
    _TokenizeDocument,
    document_dataset,
    iterator_state_to_json,
    make_pretrain_iterator,
    restore_iterator_from_json,
)
from composer_jax.data.tokenizer import ByteTokenizer, load_tokenizer

TOKENIZER = ByteTokenizer()
_ALPHABET = list("abcdefghij klmnop\n\t()=:#é中😀")


def _write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _make_tree(root, num_files: int, rng: np.random.Generator, max_chars: int) -> list[str]:
    """Writes numbered .py files with random text (plus distractors) and returns their texts."""
    texts = []
    for i in range(num_files):
        body = "".join(rng.choice(_ALPHABET, size=int(rng.integers(0, max_chars))))
        texts.append(f"# file {i}\n{body}")
        _write(os.path.join(root, f"pkg{i % 3}", f"mod_{i:03d}.py"), texts[-1])
    _write(os.path.join(root, "pkg0", "notes.txt"), "not python")
    _write(os.path.join(root, "tests", "test_x.py"), "excluded dir")
    _write(os.path.join(root, "pkg1", "__pycache__", "cached.py"), "excluded dir")
    return texts


@pytest.fixture
def code_tree(tmp_path):
    rng = np.random.default_rng()
    texts = _make_tree(str(tmp_path), num_files=24, rng=rng, max_chars=600)
    return str(tmp_path), texts


def _document_chunks(texts: list[str], seq_len: int) -> collections.Counter:
    """Every piece the pipeline should emit in one epoch (short last pieces may repeat)."""
    chunks = collections.Counter()
    for text in texts:
        tokens = TOKENIZER.encode(text, add_bos=True, add_eos=True)
        starts = range(0, len(tokens), seq_len)
        chunks.update(tuple(tokens[start : start + seq_len]) for start in starts)
    return chunks


def _segments(batch: dict[str, np.ndarray], seq_len: int):
    """Checks row invariants and yields each segment's tokens as a tuple."""
    for tokens, segment_ids, positions in zip(
        batch["tokens"], batch["segment_ids"], batch["positions"]
    ):
        num_segments = segment_ids.max()
        assert num_segments >= 1
        padding = segment_ids == 0
        assert np.all(tokens[padding] == TOKENIZER.pad_id) and np.all(positions[padding] == 0)
        # Segments are numbered 1..n left to right and padding only trails them.
        assert np.all(np.diff(segment_ids[~padding]) >= 0)
        assert not np.any(padding[: (~padding).sum()])
        for segment_id in range(1, num_segments + 1):
            in_segment = segment_ids == segment_id
            assert np.all(positions[in_segment] == np.arange(in_segment.sum()))
            yield tuple(tokens[in_segment])


def _emitted_chunks(iterator, seq_len: int) -> collections.Counter:
    return collections.Counter(
        segment for batch in iterator for segment in _segments(batch, seq_len)
    )


def _file_number(document) -> int:
    """The N of a document's '# file N' header (only in first pieces, which start with bos)."""
    return int(TOKENIZER.decode(document[:16]).split()[2])


def test_list_source_files_sorted_and_excludes(code_tree):
    root, texts = code_tree
    paths = list_source_files(root)
    relative = [os.path.relpath(path, root) for path in paths]
    assert relative == sorted(f"pkg{i % 3}/mod_{i:03d}.py" for i in range(len(texts)))
    text_files = list_source_files(root, (".txt",))
    assert [os.path.relpath(path, root) for path in text_files] == ["pkg0/notes.txt"]


def test_corpus_split_deterministic_and_disjoint(tmp_path):
    rng = np.random.default_rng()
    _make_tree(str(tmp_path), num_files=150, rng=rng, max_chars=10)
    train = CodeCorpus(str(tmp_path), split="train", eval_fraction=0.2)
    held_out = CodeCorpus(str(tmp_path), split="eval", eval_fraction=0.2)
    everything = CodeCorpus(str(tmp_path))
    assert not set(train.paths) & set(held_out.paths)
    assert sorted(train.paths + held_out.paths) == sorted(everything.paths)
    assert 5 < len(held_out) < 60
    assert train.paths == CodeCorpus(str(tmp_path), split="train", eval_fraction=0.2).paths
    assert held_out[0].startswith("# file ")


def test_corpus_errors_name_the_root(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="nowhere"):
        CodeCorpus(missing)
    with pytest.raises(ValueError, match=str(tmp_path)):
        CodeCorpus(str(tmp_path))
    with pytest.raises(ValueError, match="split"):
        CodeCorpus(str(tmp_path), split="validation")


def test_stdlib_corpus_is_found():
    corpus = CodeCorpus(default_code_root(), split="eval")
    assert len(corpus) > 0
    assert os.path.isfile(os.path.join(default_code_root(), "os.py"))
    assert len(corpus[0]) > 0


def test_packed_rows_are_pieces_of_documents(code_tree):
    root, texts = code_tree
    rng = np.random.default_rng()
    seq_len, batch_size = int(rng.integers(16, 96)), 4
    chunks = _document_chunks(texts, seq_len)
    iterator = make_pretrain_iterator(CodeCorpus(root), TOKENIZER, seq_len, batch_size, seed=3)
    for _ in range(40):  # crosses several epochs
        batch = next(iterator)
        assert set(batch) == {"tokens", "segment_ids", "positions"}
        for value in batch.values():
            assert value.shape == (batch_size, seq_len) and value.dtype == np.int32
        for segment in _segments(batch, seq_len):
            assert segment in chunks


def test_one_epoch_emits_every_chunk_once(code_tree):
    root, texts = code_tree
    seq_len = 32
    iterator = make_pretrain_iterator(
        CodeCorpus(root), TOKENIZER, seq_len, batch_size=1, seed=0, num_epochs=1
    )
    assert _emitted_chunks(iterator, seq_len) == _document_chunks(texts, seq_len)


def test_two_shards_read_disjoint_files(code_tree):
    root, texts = code_tree
    seq_len = 48
    files_per_shard = []
    for shard_index in range(2):
        iterator = make_pretrain_iterator(
            CodeCorpus(root),
            TOKENIZER,
            seq_len,
            1,
            seed=5,
            shard_index=shard_index,
            shard_count=2,
            num_epochs=1,
        )
        emitted = _emitted_chunks(iterator, seq_len)
        first_pieces = [piece for piece in emitted if piece[0] == TOKENIZER.bos_id]
        files_per_shard.append({_file_number(np.array(piece)) for piece in first_pieces})
    assert not files_per_shard[0] & files_per_shard[1]
    assert files_per_shard[0] | files_per_shard[1] == set(range(len(texts)))
    with pytest.raises(ValueError, match="shard"):
        make_pretrain_iterator(
            CodeCorpus(root), TOKENIZER, seq_len, 1, seed=0, shard_index=2, shard_count=2
        )


def test_documents_reshuffle_every_epoch(code_tree):
    root, texts = code_tree
    documents = document_dataset(CodeCorpus(root), TOKENIZER, seed=11, num_epochs=2)
    assert len(documents) == 2 * len(texts)
    file_numbers = [_file_number(doc) for doc in documents]
    first, second = file_numbers[: len(texts)], file_numbers[len(texts) :]
    assert sorted(first) == sorted(second) == list(range(len(texts)))
    assert first != second
    again = document_dataset(CodeCorpus(root), TOKENIZER, seed=11, num_epochs=2)
    assert file_numbers == [_file_number(doc) for doc in again]


@pytest.mark.parametrize("num_packing_bins", [7, 256])
def test_resume_from_json_state_is_bitwise_identical(code_tree, num_packing_bins):
    root, _ = code_tree
    rng = np.random.default_rng()
    consumed, compared = int(rng.integers(1, 60)), 12

    def fresh_iterator():
        return make_pretrain_iterator(
            CodeCorpus(root),
            TOKENIZER,
            seq_len=40,
            batch_size=3,
            seed=7,
            num_packing_bins=num_packing_bins,
        )

    iterator = fresh_iterator()
    for _ in range(consumed):
        next(iterator)
    state_json = iterator_state_to_json(iterator)
    json.loads(state_json)
    expected = [next(iterator) for _ in range(compared)]

    assert not np.array_equal(next(fresh_iterator())["tokens"], expected[0]["tokens"])
    resumed = fresh_iterator()
    restore_iterator_from_json(resumed, state_json)
    for want in expected:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_a_documents_special_token_text_is_text():
    """A corpus file holding `<|eos|>` (a tokenizer's own source, a chat log) is not cut there:
    its only eos is the one that ends it."""
    tokenizer = load_tokenizer("code_bpe_2k")
    ids = _TokenizeDocument(tokenizer).map("a = '<|eos|>'\nb = 1\n").tolist()
    assert ids[0] == tokenizer.bos_id and ids.count(tokenizer.eos_id) == 1
    assert ids[-1] == tokenizer.eos_id and "<|eos|>" in tokenizer.decode(ids)
