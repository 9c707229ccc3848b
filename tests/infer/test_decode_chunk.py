"""Several decode steps per jitted call give exactly what one step per call gives: tokens, both
log-probs, routed experts, versions and finish reasons, whatever the chunk boundaries."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from composer_jax.data.tokenizer import ByteTokenizer
from composer_jax.infer import Completion, InferenceEngine, SamplingParams
from composer_jax.infer.completion import ends_with_stop_string
from composer_jax.infer.decode import decode_chunk
from composer_jax.model.transformer import init_model
from tests.infer.test_engine import _engine as engine_for_tests

MAX_LEN = 48
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=12)
BYTES = ByteTokenizer()


def _engine(model, decode_chunk: int, num_slots: int = 3) -> InferenceEngine:
    return engine_for_tests(model, num_slots, tokenizer=BYTES, decode_chunk=decode_chunk)


def _prompt(model, n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, model.cfg.vocab_size, size=n).tolist()


def _free_run(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """The tokens the request samples when nothing stops it before its budget."""
    return _engine(model, 1).generate([prompt], params)[0].tokens


def _assert_same(got: Completion, want: Completion) -> None:
    assert got.tokens == want.tokens
    assert got.finish_reason == want.finish_reason
    assert got.versions == want.versions
    assert got.prompt == want.prompt and got.start_position == want.start_position
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got.raw_logprobs, want.raw_logprobs, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.stack(got.experts), np.stack(want.experts))
    np.testing.assert_array_equal(np.stack(got.prompt_experts), np.stack(want.prompt_experts))


def _requests(model) -> list[tuple[list[int], SamplingParams]]:
    """Seven requests of mixed prompt lengths through three slots, ending by budget, by the cache
    row's end, by stop sequences of one, two, three (spanning the token sampled after the
    prefill) and six tokens (wider than the smallest stop table), and by a stop string; greedy
    and seeded sampling."""
    long_prompt = _prompt(model, 40, seed=1)
    sampled = [dataclasses.replace(SAMPLED, seed=20 + i) for i in range(4)]
    prompts = [_prompt(model, n, seed=10 + n) for n in (3, 7, 12, 5, 20, 9)]
    free = [
        _free_run(model, p, s)
        for p, s in zip(prompts[1:], (sampled[1], GREEDY, sampled[2], GREEDY, sampled[3]))
    ]
    stop_text = BYTES.decode(free[3][5:7])
    return [
        (prompts[0], dataclasses.replace(sampled[0], max_new_tokens=6)),
        (long_prompt, dataclasses.replace(GREEDY, max_new_tokens=20)),
        (prompts[1], dataclasses.replace(sampled[1], stop_sequences=(tuple(free[0][5:7]),))),
        (prompts[2], dataclasses.replace(GREEDY, stop_sequences=((999,), (free[1][3],)))),
        (prompts[3], dataclasses.replace(sampled[2], stop_sequences=(tuple(free[2][:3]),))),
        (prompts[4], dataclasses.replace(GREEDY, stop_strings=(stop_text,))),
        (prompts[5], dataclasses.replace(sampled[3], stop_sequences=(tuple(free[4][4:10]),))),
    ]


@pytest.mark.parametrize("decode_chunk", [3, 8])
def test_chunked_decode_matches_single_steps(tiny_model, decode_chunk):
    requests = _requests(tiny_model)
    results = []
    for chunk in (1, decode_chunk):
        engine = _engine(tiny_model, chunk)
        ids = [engine.submit(prompt, params) for prompt, params in requests]
        engine.run()
        results.append([engine.completions[i] for i in ids])
    for want, got in zip(*results):
        _assert_same(got, want)
    reasons = [c.finish_reason for c in results[0]]
    assert reasons[:2] == ["length", "max_len"] and set(reasons[2:]) == {"stop"}
    assert len(results[0][1].tokens) == MAX_LEN - len(requests[1][0])
    for got, (_, params) in zip(results[0][2:], requests[2:]):
        assert len(got.tokens) < params.max_new_tokens  # each stop ends its turn early


def test_compile_all_covers_requests_with_a_few_stop_tokens(tiny_model):
    """Every decode span is compiled ahead too: the request below crosses two of them."""
    engine = engine_for_tests(tiny_model, 3, tokenizer=BYTES, decode_chunk=4, decode_spans=(8, 16))
    engine.compile_all()
    compiled = decode_chunk._cache_size()
    params = dataclasses.replace(SAMPLED, stop_sequences=((1,), (2,), (3, 4)))
    engine.generate([_prompt(tiny_model, 5, seed=9)], params)
    assert decode_chunk._cache_size() == compiled


def test_stop_string_cuts_the_chunk(tiny_model):
    """The turn ends at the first token whose text holds the stop string; the chunk's later
    tokens for that slot are dropped."""
    prompt = _prompt(tiny_model, 9, seed=2)
    free = _free_run(tiny_model, prompt, GREEDY)
    stop = BYTES.decode(free[4:6])
    params = dataclasses.replace(GREEDY, stop_strings=(stop,))
    end = next(
        k for k in range(1, len(free) + 1) if ends_with_stop_string(free[:k], params, BYTES.decode)
    )
    got = _engine(tiny_model, 8).generate([prompt], params)[0]
    assert got.tokens == free[:end] and got.finish_reason == "stop"
    assert len(got.experts) == len(got.versions) == end


def _conversation(model, decode_chunk: int) -> list[Completion]:
    """Turn 1 cut by a stop string mid-chunk, a continuation with tool output, then a restart
    from the prompt plus a summary; the other slot keeps generating throughout."""
    prompt, tool_output, summary = _prompt(model, 6, seed=3), [7, 8, 9], [4, 2]
    stop = BYTES.decode(_free_run(model, prompt, GREEDY)[5:7])
    engine = _engine(model, decode_chunk, num_slots=2)
    params = dataclasses.replace(GREEDY, keep_cache=True)
    first = engine.submit(prompt, dataclasses.replace(params, stop_strings=(stop,)))
    other = engine.submit(
        _prompt(model, 11, seed=4), dataclasses.replace(SAMPLED, max_new_tokens=30, seed=5)
    )
    while engine.completions[first].finish_reason is None:
        engine.step()
    second = engine.continue_request(first, tool_output, params)
    while engine.completions[second].finish_reason is None:
        engine.step()
    third = engine.restart_request(second, len(prompt), summary, SAMPLED)
    engine.run()
    return [engine.completions[i] for i in (first, second, third, other)]


def test_continuation_after_a_chunked_turn(tiny_model):
    """Cache entries a cut chunk wrote past the turn's end are rewritten by the next turn, so
    the continuation equals a fresh request on the whole conversation."""
    want = _conversation(tiny_model, 1)
    got = _conversation(tiny_model, 4)
    for g, w in zip(got, want):
        _assert_same(g, w)
    turn1, turn2 = got[0], got[1]
    assert turn1.finish_reason == "stop" and len(turn1.tokens) < GREEDY.max_new_tokens
    whole = _prompt(tiny_model, 6, seed=3) + turn1.tokens + [7, 8, 9]
    fresh = _engine(tiny_model, 4).generate([whole], GREEDY)[0]
    assert turn2.tokens == fresh.tokens
    np.testing.assert_allclose(turn2.raw_logprobs, fresh.raw_logprobs, atol=1e-5)


@pytest.mark.parametrize("recompute_cache", [True, False])
def test_weight_update_between_chunks(tiny_model, recompute_cache):
    """Two chunks of four (nine tokens with the one after prefill) at version 0, then new
    weights: the same as nine single steps before the update."""
    new_model = init_model(tiny_model.cfg, seed=2)
    prompts = [_prompt(tiny_model, 5, seed=5), _prompt(tiny_model, 9, seed=6)]
    params = [
        dataclasses.replace(GREEDY, max_new_tokens=20),
        dataclasses.replace(SAMPLED, max_new_tokens=20, seed=7),
    ]
    results = []
    for chunk, steps_before in ((1, 8), (4, 2)):
        engine = _engine(tiny_model, chunk)
        ids = [engine.submit(p, s) for p, s in zip(prompts, params)]
        for _ in range(steps_before):
            engine.step()
        engine.update_weights(new_model, version=1, recompute_cache=recompute_cache)
        engine.run()
        results.append([engine.completions[i] for i in ids])
    for want, got in zip(*results):
        _assert_same(got, want)
        assert got.versions == [0] * 9 + [1] * 11


def test_decode_chunk_must_be_positive(tiny_model):
    with pytest.raises(ValueError, match="decode_chunk"):
        _engine(tiny_model, 0)


def test_a_call_ends_when_a_row_finishes_so_its_slot_refills(tiny_model):
    """A row that ends mid-chunk ends the call: the next request takes its slot at once instead
    of waiting while the other rows decode the rest of the chunk."""
    engine = _engine(tiny_model, 8, num_slots=2)
    greedy = dataclasses.replace(GREEDY, max_new_tokens=3)
    short = engine.submit(_prompt(tiny_model, 6, 0), greedy)
    long = engine.submit(_prompt(tiny_model, 6, 1), dataclasses.replace(GREEDY, max_new_tokens=30))
    waiting = engine.submit(_prompt(tiny_model, 6, 2), greedy)
    assert engine.step() == [short]  # prefill's token, then a call of 2 steps, not 8
    assert len(engine.completions[long].tokens) == 3
    engine.step()  # the waiting request took the free slot
    assert engine.completions[waiting].tokens
