import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tiktoken
from tokenizers import Tokenizer as HFCore

from composer_jax.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    TokenizerError,
    check_vocab,
    get_tokenizer,
    load_tokenizer,
)
from tests.data.helpers import TRICKY_TEXTS, make_hf_folder, make_tiktoken_folder

# Mixed-width code points: ASCII, Latin-1, CJK, emoji (4-byte UTF-8), combining marks.
_ALPHABET = "abc xyz_09\n\t(){}:é߷中文字😀🐍\u0301ñ"


def _random_text(rng: np.random.Generator, length: int) -> str:
    return "".join(rng.choice(list(_ALPHABET), size=length))


def _random_texts(count=20):
    rng = np.random.default_rng()
    return [_random_text(rng, int(rng.integers(0, 200))) for _ in range(count)]


def test_byte_round_trip_unicode():
    tokenizer = ByteTokenizer()
    for text in _random_texts():
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
        assert len(ids) == tokenizer.num_bytes(text) + 2 == tokenizer.count_tokens(text) + 2
        assert max(ids[1:-1], default=0) < 256
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_byte_special_ids_and_vocab():
    tokenizer = get_tokenizer("byte")
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (256, 257, 258)
    assert tokenizer.vocab_size == 259
    assert tokenizer.encode("A", add_eos=True) == [65, 258]
    assert tokenizer.decode([257, 104, 256, 105, 258, 256]) == "hi"
    assert tokenizer.token_id("<|eos|>") == 258


def test_byte_decode_replaces_cut_characters():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("a😀b")
    assert tokenizer.decode(np.delete(ids, 2)) == "a\ufffdb"


def test_byte_tokenizer_as_hf_json_encodes_identically(tmp_path):
    """The exported form of the byte tokenizer (a merge-free byte-level BPE) gives the same ids."""
    ours = ByteTokenizer()
    ours.save(str(tmp_path))
    core = HFCore.from_file(str(tmp_path / "tokenizer.json"))
    for text in [*TRICKY_TEXTS, *_random_texts()]:
        assert core.encode(text, add_special_tokens=False).ids == ours.encode(text)
        assert core.decode(ours.encode(text, add_bos=True, add_eos=True)) == text
    assert [core.token_to_id(s) for s in ("<|pad|>", "<|bos|>", "<|eos|>")] == [256, 257, 258]
    loaded = load_tokenizer(str(tmp_path))
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.vocab_size) == (257, 258, 256, 259)


def test_hf_tokenizer_equals_the_library(tmp_path):
    make_hf_folder(tmp_path)
    ours = load_tokenizer(str(tmp_path))
    library = HFCore.from_file(str(tmp_path / "tokenizer.json"))
    assert isinstance(ours, HFTokenizer)
    for text in [*TRICKY_TEXTS, *_random_texts()]:
        ids = library.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == ids
        assert ours.decode(ids) == library.decode(ids) == text
    assert ours.encode("") == []
    assert ours.bos_id == library.token_to_id("<s>")
    assert ours.eos_id == library.token_to_id("</s>")
    assert ours.pad_id == library.token_to_id("<pad>")
    assert ours.vocab_size == library.get_vocab_size(with_added_tokens=True)
    assert ours.token_id("<|im_end|>") == library.token_to_id("<|im_end|>")
    # A special token's string in the text is that token, as in the library; decoding drops it.
    ids = ours.encode("a<|im_end|>b", add_bos=True, add_eos=True)
    assert ids[0] == ours.bos_id and ids[-1] == ours.eos_id
    assert ours.token_id("<|im_end|>") in ids and ours.decode(ids) == "ab"
    with pytest.raises(KeyError, match="no special token"):
        ours.token_id("<|nope|>")


def test_special_tokens_named_in_the_added_token_form(tmp_path):
    """tokenizer_config.json may name a special token as an AddedToken dict (DeepSeek-V3 does)."""
    make_hf_folder(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
    config.pop("pad_token")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.eos_id == tokenizer.pad_id == tokenizer.token_id("<|im_end|>")


def test_tiktoken_tokenizer_equals_the_library(tmp_path):
    ranks, pattern, special = make_tiktoken_folder(tmp_path)
    ours = load_tokenizer(str(tmp_path))
    assert isinstance(ours, TiktokenTokenizer)
    library = tiktoken.Encoding(
        name="reference", pat_str=pattern, mergeable_ranks=ranks, special_tokens=special
    )
    for text in [*TRICKY_TEXTS, *_random_texts()]:
        ids = library.encode(text, allowed_special="all")
        assert ours.encode(text) == ids
        assert ours.decode(ids) == library.decode(ids) == text
    base = len(ranks)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (base, base + 1, base + 255)
    assert ours.vocab_size == library.n_vocab == base + 256
    assert ours.token_id("<|im_end|>") == base + 2
    assert ours.token_id("<|reserved_token_%d|>" % (base + 100)) == base + 100
    ids = ours.encode("x<|im_end|>y")
    assert base + 2 in ids and ours.decode(ids) == "xy"


def test_tiktoken_reserved_count_and_extra_added_tokens(tmp_path):
    """Kimi-Linear's layout: added tokens beyond the reserved block extend the vocabulary."""
    ranks, _, _ = make_tiktoken_folder(tmp_path, reserved=16)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    base = len(ranks)
    config["added_tokens_decoder"] = {
        k: v for k, v in config["added_tokens_decoder"].items() if int(k) < base + 16
    }
    config["added_tokens_decoder"][str(base + 17)] = {"content": "[PAD]", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_tokenizer(str(tmp_path))
    assert ours.vocab_size == base + 18
    assert ours.pad_id == base + 17
    assert ours.token_id(f"<|reserved_token_{base + 16}|>") == base + 16


@pytest.mark.parametrize("kind", ["byte", "hf", "tiktoken"])
def test_token_texts_join_to_the_decoding(tmp_path, kind):
    if kind == "byte":
        tokenizer = ByteTokenizer()
    elif kind == "hf":
        make_hf_folder(tmp_path)
        tokenizer = load_tokenizer(str(tmp_path))
    else:
        make_tiktoken_folder(tmp_path)
        tokenizer = load_tokenizer(str(tmp_path))
    for text in [*TRICKY_TEXTS, *_random_texts()]:
        ids = tokenizer.encode(text)
        pieces = tokenizer.token_texts(ids)
        assert len(pieces) == len(ids)
        assert "".join(pieces) == tokenizer.decode(ids) == text
    # A token's piece is its own text once the characters before it are complete.
    ids = tokenizer.encode("ab<final>") + tokenizer.encode("Done") + [tokenizer.eos_id]
    pieces = tokenizer.token_texts(ids)
    assert "".join(pieces) == "ab<final>Done" and pieces[-1] == ""


def test_token_texts_with_a_sentencepiece_style_decoder(tmp_path):
    """Metaspace decoders drop the leading space of a decoding's first token: the pieces still
    join to the decoding."""
    from tokenizers import Tokenizer as Core
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from tests.data.helpers import TRAINING_TEXT

    core = Core(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    core.train_from_iterator(TRAINING_TEXT, trainer)
    core.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    tokenizer = load_tokenizer(str(tmp_path))
    for text in [*TRICKY_TEXTS, *_random_texts()]:
        ids = tokenizer.encode(text)
        assert "".join(tokenizer.token_texts(ids)) == tokenizer.decode(ids)
    ids = tokenizer.encode("def add(a, b): return a")
    assert tokenizer.token_texts(ids)[1:] == [
        tokenizer.decode(ids[: i + 1])[len(tokenizer.decode(ids[:i])) :] for i in range(1, len(ids))
    ]


def test_save_copies_the_defining_files(tmp_path):
    make_tiktoken_folder(tmp_path / "src")
    source = load_tokenizer(str(tmp_path / "src"))
    source.save(str(tmp_path / "copy"))
    copy = load_tokenizer(str(tmp_path / "copy"))
    assert sorted(os.listdir(tmp_path / "copy")) == [
        "tiktoken.model",
        "tokenization_kimi.py",
        "tokenizer_config.json",
    ]
    for text in TRICKY_TEXTS:
        assert copy.encode(text) == source.encode(text)
    assert copy.chat_template == source.chat_template is not None


def test_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(TokenizerError, match="sentencepiece"):
        get_tokenizer("sentencepiece")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="neither tokenizer.json nor tiktoken.model"):
        load_tokenizer(str(tmp_path / "empty"))
    make_hf_folder(tmp_path / "no_eos")
    (tmp_path / "no_eos" / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    with pytest.raises(TokenizerError, match="no eos token"):
        load_tokenizer(str(tmp_path / "no_eos"))
    make_hf_folder(tmp_path / "bad_eos")
    (tmp_path / "bad_eos" / "tokenizer_config.json").write_text('{"eos_token": "<nope>"}')
    with pytest.raises(TokenizerError, match="eos_token '<nope>' is not in the vocabulary"):
        load_tokenizer(str(tmp_path / "bad_eos"))
    make_tiktoken_folder(tmp_path / "bad_ranks")
    with open(tmp_path / "bad_ranks" / "tiktoken.model", "a") as f:
        f.write("not-base64!! x\n")
    with pytest.raises(TokenizerError, match="tiktoken.model:"):
        load_tokenizer(str(tmp_path / "bad_ranks"))
    make_tiktoken_folder(tmp_path / "no_pattern")
    os.remove(tmp_path / "no_pattern" / "tokenization_kimi.py")
    with pytest.raises(TokenizerError, match="pat_str"):
        load_tokenizer(str(tmp_path / "no_pattern"))
    with pytest.raises(TokenizerError, match="model.vocab_size: 100 is smaller"):
        check_vocab(ByteTokenizer(), 100)
    check_vocab(ByteTokenizer(), 259)


def test_tokenizer_and_chat_modules_import_without_jax():
    code = (
        "import sys; import composer_jax.data.tokenizer, composer_jax.data.chat; "
        "from composer_jax.data import load_tokenizer; "
        "assert 'jax' not in sys.modules, 'jax was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())
