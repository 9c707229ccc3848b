"""Text-level stops and the text-in/text-out API on a real BPE tokenizer."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from composer_jax import infer
from composer_jax.data.tokenizer import TokenizerError, load_tokenizer
from composer_jax.infer import InferenceEngine, SamplingParams, recompute_generate
from composer_jax.model.transformer import compute_logits, init_model
from tests.data.helpers import make_hf_folder
from tests.infer.conftest import model_config

MAX_LEN = 64


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    make_hf_folder(folder, vocab_size=400)
    return load_tokenizer(str(folder))


@pytest.fixture(scope="module")
def bpe_model():
    return init_model(model_config(vocab_size=416), seed=5)


def _engine(model, **kw):
    """The shapes `generate` builds for up to four short prompts (compiled once)."""
    return InferenceEngine(model, num_slots=4, max_len=MAX_LEN, prefill_buckets=(16, MAX_LEN), **kw)


def test_stop_string_ends_where_its_text_is_complete(bpe, bpe_model):
    """A stop string that starts and ends inside tokens stops generation at the first token
    whose decoded prefix contains it, whatever tokens spell it."""
    prompt = bpe.encode("def f(x):", add_bos=True)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    free = _engine(bpe_model).generate([prompt], greedy)[0].tokens
    text = bpe.decode(free)
    assert len(text) > 12, text
    rng = np.random.default_rng()
    start = int(rng.integers(1, len(text) - 8))
    stop = text[start : start + int(rng.integers(2, 6))]
    end = next(k for k in range(1, len(free) + 1) if stop in bpe.decode(free[:k]))
    params = dataclasses.replace(greedy, stop_strings=(stop, "\x00never"))
    got = _engine(bpe_model, tokenizer=bpe).generate([prompt], params)[0]
    assert got.tokens == free[:end] and got.finish_reason == "stop"
    by_spec = dataclasses.replace(params, tokenizer=bpe.spec)
    assert _engine(bpe_model).generate([prompt], by_spec)[0].tokens == free[:end]
    with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
        _engine(bpe_model).submit(prompt, params)


def test_generate_is_the_reference_decoding(bpe, bpe_model):
    prompts = ["def add(a, b):", "héllo wörld", "class Foo:\n    def"]
    got = infer.generate(bpe_model, bpe, prompts, max_new_tokens=12)
    for prompt, text in zip(prompts, got):
        params = SamplingParams(temperature=0.0, max_new_tokens=12, stop_sequences=((bpe.eos_id,),))
        want, _, _ = recompute_generate(
            bpe_model, bpe.encode(prompt, add_bos=True), params, MAX_LEN
        )
        assert text == bpe.decode(want)
    # Stop strings cut the returned text before them; an engine can be reused.
    stop = got[0][3:5]
    engine = _engine(bpe_model, tokenizer=bpe)
    cut = infer.generate(engine, bpe, prompts, max_new_tokens=12, stop=(stop,))
    assert cut[0] == got[0][: got[0].index(stop)]
    # Sampled: prompt i draws with seed + i at the given temperature and top-p, as the reference
    # decoding draws; another seed gives other text.
    sampled = infer.generate(bpe_model, bpe, prompts, 12, temperature=0.8, top_p=0.9, seed=3)
    for i, (prompt, text) in enumerate(zip(prompts, sampled)):
        params = SamplingParams(
            temperature=0.8,
            top_p=0.9,
            seed=3 + i,
            max_new_tokens=12,
            stop_sequences=((bpe.eos_id,),),
        )
        want, _, _ = recompute_generate(
            bpe_model, bpe.encode(prompt, add_bos=True), params, MAX_LEN
        )
        assert text == bpe.decode(want), i
    assert sampled != infer.generate(
        bpe_model, bpe, prompts, 12, temperature=0.8, top_p=0.9, seed=4
    )


def test_generate_with_the_chat_template(bpe, bpe_model):
    from composer_jax.data.chat import chat_format_for

    chat = chat_format_for(bpe)
    params = SamplingParams(
        temperature=0.0,
        max_new_tokens=10,
        stop_sequences=tuple((i,) for i in chat.stop_token_ids),
    )
    got = infer.generate(bpe_model, bpe, ["hi", "ho", "ha"], 10, chat=True)
    for message, text in zip(["hi", "ho", "ha"], got, strict=True):
        want, _, _ = recompute_generate(bpe_model, chat.prompt(message), params, MAX_LEN)
        assert text == bpe.decode(want), message


def test_vocab_mismatch_is_a_clear_error(bpe):
    from flax import nnx

    from composer_jax.model.transformer import Transformer

    small = nnx.eval_shape(lambda: Transformer(model_config(vocab_size=300), nnx.Rngs(0)))
    with pytest.raises(TokenizerError, match="model.vocab_size: 300 is smaller"):
        infer.generate(small, bpe, ["x"])


def test_compute_logits_takes_one_sequence(bpe_model):
    tokens = np.random.default_rng().integers(0, 416, size=11)
    one = np.asarray(compute_logits(bpe_model, tokens))
    batch = np.asarray(compute_logits(bpe_model, tokens[None]))
    assert one.shape == (11, 416)
    np.testing.assert_array_equal(one, batch[0])
    positions = np.arange(11) + 3
    np.testing.assert_array_equal(
        np.asarray(compute_logits(bpe_model, tokens, positions)),
        np.asarray(compute_logits(bpe_model, tokens[None], positions[None]))[0],
    )
