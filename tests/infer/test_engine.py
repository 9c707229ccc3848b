"""Continuous batching, stop sequences, multi-turn continuation, in-flight weight swap, meshes."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from composer_jax.config import MeshConfig
from composer_jax.infer import InferenceEngine, SamplingParams, recompute_generate
from composer_jax.infer.cache import copy_slot
from composer_jax.infer.decode import decode_chunk
from composer_jax.infer.forward import prefill_chunk
from composer_jax.model.layers import logical_axes_of
from composer_jax.model.transformer import init_model
from composer_jax.parallel import mesh as mesh_lib
from composer_jax.trace import Tracer

MAX_LEN = 48
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def _engine(model, num_slots=2, **kw):
    return InferenceEngine(
        model,
        num_slots=num_slots,
        max_len=MAX_LEN,
        prefill_buckets=(8,),
        prefill_batch_sizes=(num_slots,),
        **kw,
    )


def _prompt(model, n, seed):
    return np.random.default_rng(seed).integers(0, model.cfg.vocab_size, size=n).tolist()


def test_continuous_batching_matches_one_at_a_time(tiny_model):
    """Five sampled requests of different lengths through two slots (requests join as others
    leave) give exactly what each request gives alone, with RL outputs per token."""
    requests = [
        (
            _prompt(tiny_model, 3 + i, seed=i),
            SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=3 + 2 * i, seed=10 + i),
        )
        for i in range(5)
    ]
    batched = _engine(tiny_model)
    ids = [batched.submit(p, s) for p, s in requests]
    batched.run()
    compiled = prefill_chunk._cache_size()
    alone = _engine(tiny_model)
    cfg = tiny_model.cfg
    for rid, (prompt, params) in zip(ids, requests):
        got = batched.completions[rid]
        want = alone.generate([prompt], params)[0]
        assert got.tokens == want.tokens and len(got.tokens) == params.max_new_tokens
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
        np.testing.assert_allclose(got.raw_logprobs, want.raw_logprobs, atol=1e-5)
        assert got.versions == [0] * len(got.tokens)
        experts = np.stack(got.experts)
        assert experts.shape == (len(got.tokens), cfg.num_moe_layers, cfg.num_experts_per_tok)
        assert ((experts >= 0) & (experts < cfg.num_experts)).all()
        np.testing.assert_array_equal(experts, np.stack(want.experts))
        assert np.stack(got.prompt_experts).shape[0] == len(prompt)
        np.testing.assert_array_equal(got.prompt_experts[-1], got.experts[0])
    assert prefill_chunk._cache_size() == compiled  # bucketed shapes: no compile per request


def test_weights_committed_to_a_device_compile_each_step_once(tiny_model):
    """Weights committed to a device (a loaded checkpoint's) with the engine's new cache: the
    cache is committed alike, so the second request's prefill is not traced again."""
    model = init_model(tiny_model.cfg, seed=1)
    nnx.update(model, jax.device_put(nnx.state(model), jax.devices()[0]))
    engine = _engine(model)
    assert all(leaf.committed for leaf in jax.tree.leaves((engine.state, engine.cache)))
    prefill_chunk.clear_cache()
    engine.generate([_prompt(model, 3, seed=0)], GREEDY)
    compiled = prefill_chunk._cache_size()
    engine.generate([_prompt(model, 4, seed=1)], GREEDY)
    assert prefill_chunk._cache_size() == compiled


@pytest.mark.parametrize("num_slots, engine_mesh", [(2, False), (8, False), (8, True)])
def test_a_cache_across_devices_compiles_each_step_once(tiny_model, num_slots, engine_mesh):
    """Weights a trainer sharded over 8 devices and an engine without a mesh (the held-out
    check's, the RL sampler's: its cache goes on the weights' mesh, slots split where 8 divides
    them, else replicated), or an engine given a mesh: every call returns the cache laid out and
    spelled as it was made, so no prefill or decode shape compiles a second time (for the new
    cache, then for the first call's output); the samples are the one-device engine's."""
    model = init_model(tiny_model.cfg, seed=1)
    layout = mesh_lib.make_layout(MeshConfig(), jax.devices()[:8])
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, layout.tree_shardings(logical_axes_of(state), state)))
    engine = _engine(model, num_slots=num_slots, mesh=layout.mesh if engine_mesh else None)
    spec = engine.cache.c_kv_LNSR.sharding.spec
    assert (len(spec) > 1 and spec[1] is not None) == (num_slots == 8)  # slots split or not
    prompts = [[_prompt(model, n, seed=n)] * 2 for n in (3, 4, 5)]  # the second copies the first
    prefill_chunk.clear_cache()
    got = [engine.generate(p, GREEDY) for p in prompts[:1]]
    compiled = (prefill_chunk._cache_size(), decode_chunk._cache_size(), copy_slot._cache_size())
    got += [engine.generate(p, GREEDY) for p in prompts[1:]]
    assert (
        prefill_chunk._cache_size(),
        decode_chunk._cache_size(),
        copy_slot._cache_size(),
    ) == compiled
    one_device = _engine(init_model(tiny_model.cfg, seed=1), num_slots=num_slots)
    want = [one_device.generate(p, GREEDY) for p in prompts]
    assert [[c.tokens for c in g] for g in got] == [[c.tokens for c in w] for w in want]


def test_stop_sequence_ends_generation(tiny_model):
    prompt = _prompt(tiny_model, 5, seed=3)
    engine = _engine(tiny_model)
    free = engine.generate([prompt], dataclasses.replace(GREEDY, max_new_tokens=8))[0].tokens
    stop = tuple(free[3:5])
    end = next(i + 2 for i in range(len(free) - 1) if tuple(free[i : i + 2]) == stop)
    params = dataclasses.replace(GREEDY, max_new_tokens=8, stop_sequences=((999,), stop))
    rid = engine.submit(prompt, params)
    finished = []
    while engine.has_work:
        finished += engine.step()
    got = engine.completions[rid]
    assert got.tokens == free[:end] and got.finish_reason == "stop" and finished == [rid]


def test_multi_turn_continuation_reuses_cache(tiny_model):
    """Turn 2 prefills only the last token of turn 1 and the appended tool output, and equals a
    fresh request whose prompt is the whole conversation."""
    prompt, tool_output = _prompt(tiny_model, 6, seed=4), [7, 8, 9]
    engine = _engine(tiny_model)
    first = engine.submit(prompt, dataclasses.replace(GREEDY, keep_cache=True))
    engine.run()
    turn1 = engine.completions[first]
    assert turn1.finish_reason == "length" and not engine.has_work
    second = engine.continue_request(first, tool_output, GREEDY)
    engine.run()
    turn2 = engine.completions[second]
    assert turn2.prompt == [turn1.tokens[-1]] + tool_output
    assert turn2.start_position == len(prompt) + len(turn1.tokens) - 1
    assert len(turn2.prompt_experts) == 1 + len(tool_output)
    fresh = engine.generate([prompt + turn1.tokens + tool_output], GREEDY)[0]
    assert turn2.tokens == fresh.tokens
    np.testing.assert_allclose(turn2.raw_logprobs, fresh.raw_logprobs, atol=1e-4)


def test_a_fresh_prompts_prefill_reads_no_cache(tiny_model):
    """A fresh prompt's first chunk attends over its own tokens alone, its later chunks and a
    second turn over the cache too; every turn equals recomputing the conversation."""
    tracer = Tracer()
    engine = _engine(tiny_model, tracer=tracer)
    prompt, tool_output = _prompt(tiny_model, 19, seed=8), [7, 8, 9]  # chunks of 8, 8 and 3
    first = engine.submit(prompt, dataclasses.replace(GREEDY, keep_cache=True))
    engine.run()
    turn1 = engine.completions[first]
    second = engine.continue_request(first, tool_output, GREEDY)
    engine.run()
    spans = [event["args"]["span"] for event in tracer.events() if event.get("cat") == "prefill"]
    assert spans == [0, MAX_LEN, MAX_LEN, MAX_LEN]
    want, _, raw = recompute_generate(tiny_model, prompt, GREEDY, MAX_LEN)
    assert turn1.tokens == want
    np.testing.assert_allclose(turn1.raw_logprobs, raw, atol=1e-4)
    conversation = prompt + turn1.tokens + tool_output
    want, _, raw = recompute_generate(tiny_model, conversation, GREEDY, MAX_LEN)
    assert engine.completions[second].tokens == want
    np.testing.assert_allclose(engine.completions[second].raw_logprobs, raw, atol=1e-4)


def test_in_flight_weight_swap(tiny_model):
    """Tokens sampled before the swap carry version 0, after it version 1, and the continuation is
    what the new weights produce from the prefix; a second sequence runs through the swap."""
    new_model = init_model(tiny_model.cfg, seed=2)
    prompts = [_prompt(tiny_model, 5, seed=5), _prompt(tiny_model, 9, seed=6)]
    params = dataclasses.replace(GREEDY, max_new_tokens=9)
    engine = _engine(tiny_model)
    ids = [engine.submit(p, params) for p in prompts]
    for _ in range(3):
        engine.step()
    before = [len(engine.completions[i].tokens) for i in ids]
    assert all(0 < n < params.max_new_tokens for n in before)
    compiled = prefill_chunk._cache_size()
    engine.update_weights(nnx.split(new_model)[1], version=1)
    engine.run()
    assert prefill_chunk._cache_size() == compiled  # the swap does not recompile
    for rid, prompt, n in zip(ids, prompts, before):
        got = engine.completions[rid]
        assert got.versions == [0] * n + [1] * (params.max_new_tokens - n)
        old, _, _ = recompute_generate(tiny_model, prompt, params, MAX_LEN)
        assert got.tokens[:n] == old[:n]
        rest = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - n)
        new, _, raw = recompute_generate(new_model, prompt + got.tokens[:n], rest, MAX_LEN)
        assert got.tokens[n:] == new
        np.testing.assert_allclose(got.raw_logprobs[n:], raw, atol=1e-4)


def test_weight_swap_keeping_stale_cache(tiny_model):
    """Without recomputing the cache the swap is free (nothing is prefilled again); versions
    switch at the swap, and the tokens after it are the new weights' reading the old weights'
    cache: their log-probs are neither the old model's nor the new model's on a fresh cache."""
    new_model = init_model(tiny_model.cfg, seed=2)
    engine = _engine(tiny_model)
    prompt = _prompt(tiny_model, 5, seed=7)
    prefills = []
    prefill_batch = engine._prefill_batch
    engine._prefill_batch = lambda bucket, group: (
        prefills.append(len(group)) or prefill_batch(bucket, group)
    )
    rid = engine.submit(prompt, GREEDY)
    engine.step()
    n = len(engine.completions[rid].tokens)
    before = len(prefills)
    engine.update_weights(new_model, version=7, recompute_cache=False)
    engine.run()
    got = engine.completions[rid]
    assert got.versions == [0] * n + [7] * (GREEDY.max_new_tokens - n)
    assert len(prefills) == before  # the swap prefilled nothing
    rest = dataclasses.replace(GREEDY, max_new_tokens=GREEDY.max_new_tokens - n)
    _, _, fresh = recompute_generate(new_model, prompt + got.tokens[:n], rest, MAX_LEN)
    _, _, old = recompute_generate(tiny_model, prompt + got.tokens[:n], rest, MAX_LEN)
    first = got.raw_logprobs[n]
    assert abs(first - fresh[0]) > 1e-4 and abs(first - old[0]) > 1e-4


@pytest.mark.slow  # the expert-parallel test below covers slot-sharded caches in the fast suite
def test_sharded_engine_matches_recompute(tiny_model):
    """Eight cache slots split over an 8-device mesh, weights replicated: the data-parallel
    layout (expert-parallel dispatch is not exercised here)."""
    mesh = mesh_lib.make_mesh(MeshConfig(), jax.devices()[:8])
    _check_eight_slots(tiny_model, _engine(tiny_model, num_slots=8, mesh=mesh))


@pytest.mark.parametrize("decode_chunk", [1, 4])
def test_expert_parallel_engine_matches_recompute(tiny_model, decode_chunk):
    """Weights sharded by the training layout's rule tables and the MoE traced under the layout,
    so it dispatches tokens to experts sharded over 8 devices (EP=8), one decode step per call
    or several."""
    layout = mesh_lib.make_layout(MeshConfig(), jax.devices()[:8])
    assert layout.ep_size == 8
    state = nnx.split(tiny_model)[1]
    engine = _engine(
        tiny_model,
        num_slots=8,
        mesh=layout.mesh,
        param_shardings=layout.tree_shardings(logical_axes_of(state), state),
        trace_context=lambda: mesh_lib.use_layout(layout),
        decode_chunk=decode_chunk,
        decode_spans=(8, 16),  # the slot-sharded cache read in spans shorter than max_len
    )
    _check_eight_slots(tiny_model, engine)


def _check_eight_slots(model, engine):
    prompts = [_prompt(model, 2 + i, seed=20 + i) for i in range(8)]
    params = dataclasses.replace(GREEDY, max_new_tokens=4)
    for prompt, got in zip(prompts, engine.generate(prompts, params)):
        want, _, raw = recompute_generate(model, prompt, params, MAX_LEN)
        assert got.tokens == want
        np.testing.assert_allclose(got.raw_logprobs, raw, atol=1e-4)


def test_compile_all_leaves_cache_untouched(tiny_model):
    engine = _engine(tiny_model)
    before = [np.asarray(a).copy() for a in engine.cache]
    engine.cache = type(engine.cache)(*(a + 1.0 for a in engine.cache))
    engine.compile_all()
    for a, b in zip(engine.cache, before):
        np.testing.assert_array_equal(np.asarray(a), b + 1.0)


def test_sequence_stops_at_max_len(tiny_model):
    """A 40-token prompt (five prefill chunks) stops when the cache row is full."""
    prompt = _prompt(tiny_model, 40, seed=8)
    params = dataclasses.replace(GREEDY, max_new_tokens=20)
    got = _engine(tiny_model).generate([prompt], params)[0]
    want, _, _ = recompute_generate(tiny_model, prompt, params, MAX_LEN)
    assert got.finish_reason == "max_len" and len(got.tokens) == MAX_LEN - 40
    assert got.tokens == want
