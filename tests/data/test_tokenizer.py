import numpy as np
import pytest

from composer_jax.data.tokenizer import ByteTokenizer, get_tokenizer

# Mixed-width code points: ASCII, Latin-1, CJK, emoji (4-byte UTF-8), combining marks.
_ALPHABET = "abc xyz_09\n\t(){}:é߷中文字😀🐍\u0301ñ"


def _random_text(rng: np.random.Generator, length: int) -> str:
    return "".join(rng.choice(list(_ALPHABET), size=length))


def test_round_trip_unicode():
    rng = np.random.default_rng()
    tokenizer = ByteTokenizer()
    for _ in range(20):
        text = _random_text(rng, int(rng.integers(0, 200)))
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        assert ids.dtype == np.int32
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
        assert len(ids) == tokenizer.num_bytes(text) + 2
        assert np.all(ids[1:-1] < 256)
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_ids_and_vocab():
    tokenizer = get_tokenizer("byte")
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (256, 257, 258)
    assert tokenizer.vocab_size == 259
    assert list(tokenizer.encode("A", add_eos=True)) == [65, 258]
    assert tokenizer.decode([257, 104, 256, 105, 258, 256]) == "hi"


def test_decode_replaces_cut_characters():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("a😀b")
    assert tokenizer.decode(np.delete(ids, 2)) == "a\ufffdb"


def test_unknown_tokenizer_names_the_name():
    with pytest.raises(ValueError, match="sentencepiece"):
        get_tokenizer("sentencepiece")
