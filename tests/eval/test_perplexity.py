import math
import os

import numpy as np
import pytest

from composer_jax.data.corpus import list_source_files, read_source
from composer_jax.data.tokenizer import ByteTokenizer, load_tokenizer
from composer_jax.eval import perplexity
from composer_jax.eval.perplexity import (
    codebase_perplexity,
    read_codebase_text,
    strided_nll,
    window_starts,
)

TOKENIZER = ByteTokenizer()
VOCAB = TOKENIZER.vocab_size
_ALPHABET = list("def x(): return 1\n\t#éß中😀")


@pytest.fixture
def code_root(tmp_path):
    rng = np.random.default_rng()
    for i in range(5):
        directory = tmp_path / f"pkg{i % 2}"
        directory.mkdir(exist_ok=True)
        body = "".join(rng.choice(_ALPHABET, size=int(rng.integers(20, 150))))
        (directory / f"m{i}.py").write_text(body, encoding="utf-8")
    (tmp_path / "readme.md").write_text("not python", encoding="utf-8")
    return str(tmp_path)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _bigram_logits_fn(rng: np.random.Generator):
    table_VV = rng.normal(scale=2.0, size=(VOCAB, VOCAB)).astype(np.float32)
    return table_VV, lambda tokens_BT: table_VV[np.asarray(tokens_BT)]


def _context_logits_fn(rng: np.random.Generator, max_len: int):
    """Logits that also depend on the window's first token and on the position in the window."""
    token_VV, first_VV, position_TV = (
        rng.normal(size=shape).astype(np.float32)
        for shape in [(VOCAB, VOCAB), (VOCAB, VOCAB), (max_len, VOCAB)]
    )

    def logits_fn(tokens_BT):
        tokens_BT = np.asarray(tokens_BT)
        return token_VV[tokens_BT] + first_VV[tokens_BT[:, :1]] + position_TV[: tokens_BT.shape[1]]

    return logits_fn


def _reference_strided_nll(logits_fn, tokens: np.ndarray, window: int, stride: int):
    """One window at a time, straight from the definition in the perplexity module docstring."""
    last_target = len(tokens) - 1
    total, count, last_scored, start = 0.0, 0, 0, 0
    while last_scored < last_target:
        start = min(start, max(0, last_target - window))
        inputs = tokens[start : start + window][: last_target - start]
        log_probs = _log_softmax(logits_fn(inputs[None])[0])
        for offset, target_index in enumerate(range(start + 1, start + 1 + len(inputs))):
            if target_index > last_scored:
                total -= log_probs[offset, tokens[target_index]]
                count += 1
        last_scored = start + len(inputs)
        start += stride
    return total, count


def _random_window_and_stride(rng: np.random.Generator) -> tuple[int, int]:
    window = int(rng.integers(3, 48))
    return window, int(rng.choice([1, window, rng.integers(1, window + 1)]))


def test_codebase_text_joins_sorted_files_with_newlines(code_root):
    paths = list_source_files(code_root)
    assert [os.path.basename(p) for p in paths] == ["m0.py", "m2.py", "m4.py", "m1.py", "m3.py"]
    text = read_codebase_text(code_root)
    assert text == "\n".join(read_source(p) for p in paths)
    cut = read_codebase_text(code_root, max_bytes=101)
    assert text.startswith(cut) and 97 <= TOKENIZER.num_bytes(cut) <= 101


def test_bigram_model_matches_brute_force_for_any_window(code_root):
    rng = np.random.default_rng()
    table_VV, logits_fn = _bigram_logits_fn(rng)
    tokens = TOKENIZER.encode(read_codebase_text(code_root), add_bos=True)
    log_probs = _log_softmax(table_VV[tokens[:-1]])
    expected_nll = -log_probs[np.arange(len(tokens) - 1), tokens[1:]].sum()
    for _ in range(6):
        window, stride = _random_window_and_stride(rng)
        result = codebase_perplexity(
            logits_fn,
            TOKENIZER,
            code_root,
            window=window,
            stride=stride,
            batch_size=int(rng.integers(1, 6)),
        )
        assert result.num_tokens == len(tokens) - 1 == result.num_bytes
        np.testing.assert_allclose(result.total_nll, expected_nll, rtol=1e-5)


def test_context_dependent_model_matches_reference_loop():
    rng = np.random.default_rng()
    logits_fn = _context_logits_fn(rng, max_len=256)
    byte_ids = rng.integers(0, 256, size=int(rng.integers(60, 200)))
    tokens = np.concatenate([[TOKENIZER.bos_id], byte_ids])
    cases = [_random_window_and_stride(rng) for _ in range(6)]
    cases += [(len(tokens) - 1, 2), (len(tokens) + 5, 3), (len(tokens) - 2, len(tokens) - 2)]
    for window, stride in cases:
        expected = _reference_strided_nll(logits_fn, tokens, window, stride)
        total, count = strided_nll(
            logits_fn,
            tokens,
            window=window,
            stride=stride,
            pad_id=TOKENIZER.pad_id,
            batch_size=int(rng.integers(1, 5)),
        )
        assert count == expected[1] == len(tokens) - 1
        np.testing.assert_allclose(total, expected[0], rtol=1e-5)
    # The windows really change the answer for this model, so the comparison above has teeth.
    few_context = strided_nll(logits_fn, tokens, window=8, stride=8, pad_id=TOKENIZER.pad_id)
    much_context = strided_nll(logits_fn, tokens, window=8, stride=1, pad_id=TOKENIZER.pad_id)
    assert abs(few_context[0] - much_context[0]) > 1e-3


def test_window_starts_cover_every_target_once():
    rng = np.random.default_rng()
    for _ in range(50):
        n_tokens = int(rng.integers(2, 300))
        window = int(rng.integers(1, 40))
        stride = int(rng.integers(1, window + 1))
        starts = window_starts(n_tokens, window, stride)
        assert starts[0] == 0 and all(0 < b - a <= stride for a, b in zip(starts, starts[1:]))
        assert starts[-1] == max(0, n_tokens - 1 - window)


def test_result_formulas(code_root):
    rng = np.random.default_rng()
    _, logits_fn = _bigram_logits_fn(rng)
    result = codebase_perplexity(
        logits_fn, TOKENIZER, code_root, window=16, stride=5, max_bytes=200
    )
    assert result.num_bytes <= 200 and result.num_tokens == result.num_bytes
    assert math.isclose(result.nll_per_token, result.total_nll / result.num_tokens)
    assert math.isclose(result.perplexity, math.exp(result.total_nll / result.num_tokens))
    assert math.isclose(result.bits_per_byte, result.total_nll / math.log(2) / result.num_bytes)


@pytest.mark.parametrize("stride", [0, -3, 17])
def test_bad_stride_is_rejected(code_root, stride):
    _, logits_fn = _bigram_logits_fn(np.random.default_rng())
    with pytest.raises(ValueError, match="stride"):
        codebase_perplexity(logits_fn, TOKENIZER, code_root, window=16, stride=stride)


def test_code_holding_a_special_tokens_text_is_scored_on_the_tokens_training_reads(
    tmp_path, monkeypatch
):
    """`x = '<|eos|>'` is text in a training document; scored here, it was the eos token."""
    (tmp_path / "a.py").write_text("x = '<|eos|>'\n")
    tokenizer = load_tokenizer("code_bpe_2k")
    scored = []
    monkeypatch.setattr(
        perplexity, "strided_nll", lambda fn, tokens, **kw: scored.append(list(tokens)) or (0, 1)
    )
    codebase_perplexity(None, tokenizer, str(tmp_path), window=8, stride=8)
    want = tokenizer.encode("x = '<|eos|>'\n", add_bos=True, special=False)
    assert scored == [want] and tokenizer.eos_id not in want
