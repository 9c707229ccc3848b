"""Requests with one prompt (the samples of an RL group) copy its cached latents and experts from a
slot that holds it, and sample what a full prefill would have given."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from composer_jax.config import MeshConfig
from composer_jax.infer import InferenceEngine, SamplingParams, recompute_generate
from composer_jax.model.transformer import init_model
from composer_jax.parallel import mesh as mesh_lib

MAX_LEN = 64
SAMPLED = SamplingParams(temperature=0.9, max_new_tokens=6)


def _engine(model, share: bool, num_slots: int = 4, **kw) -> InferenceEngine:
    engine = InferenceEngine(
        model,
        num_slots=num_slots,
        max_len=MAX_LEN,
        prefill_buckets=(8, 16),
        share_prefixes=share,
        **kw,
    )
    engine.prefilled_rows = 0
    prefill_batch = engine._prefill_batch

    def counted(bucket, group):
        engine.prefilled_rows += len(group)
        return prefill_batch(bucket, group)

    engine._prefill_batch = counted
    return engine


def _prompt(model, n, seed):
    return np.random.default_rng(seed).integers(0, model.cfg.vocab_size, size=n).tolist()


def _same(got, want):
    """Same tokens, log-probs within float32 noise, same routed experts of every position."""
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    np.testing.assert_allclose(got.raw_logprobs, want.raw_logprobs, atol=1e-5)
    np.testing.assert_array_equal(np.stack(got.experts), np.stack(want.experts))
    assert len(got.prompt_experts) == len(want.prompt_experts)
    np.testing.assert_array_equal(np.stack(got.prompt_experts), np.stack(want.prompt_experts))


def _play(engine, requests, late: int = 0):
    """Submits `requests` (the last `late` of them after two steps) and runs them all."""
    ids = [engine.submit(p, s) for p, s in requests[: len(requests) - late]]
    for _ in range(2):
        engine.step()
    ids += [engine.submit(p, s) for p, s in requests[len(requests) - late :]]
    engine.run()
    return [engine.completions[i] for i in ids]


def test_a_group_prefills_its_prompt_once(tiny_model):
    """Four samples of a 20-token prompt (two chunks) and one other prompt, then two more samples
    while the first are decoding: the prompt is prefilled once, every other sample copies it,
    and each request equals what the engine without sharing samples, and the recomputed
    reference."""
    prompt, other = _prompt(tiny_model, 20, seed=1), _prompt(tiny_model, 7, seed=2)
    requests = [(prompt, dataclasses.replace(SAMPLED, seed=s)) for s in range(4)]
    requests += [(other, dataclasses.replace(SAMPLED, seed=9))]
    requests += [(prompt, dataclasses.replace(SAMPLED, seed=s)) for s in (4, 5)]
    shared, plain = _engine(tiny_model, True, 8), _engine(tiny_model, False, 8)
    got, want = _play(shared, requests, late=2), _play(plain, requests, late=2)
    for g, w in zip(got, want):
        _same(g, w)
    assert plain.prefilled_rows == 2 * 6 + 1  # the long prompt takes two chunks each time
    assert shared.prefilled_rows == 2 + 1
    for (p, params), completion in zip(requests, got):
        tokens, _, raw = recompute_generate(tiny_model, p, params, MAX_LEN)
        assert completion.tokens == tokens
        np.testing.assert_allclose(completion.raw_logprobs, raw, atol=1e-4)


def test_a_copied_prompt_continues_to_a_second_turn(tiny_model):
    """A request that copied its prompt keeps its cache for a second turn like any other."""
    prompt, tool_output = _prompt(tiny_model, 12, seed=3), [5, 6, 7]
    keep = dataclasses.replace(SAMPLED, keep_cache=True)
    turns = []
    for share in (True, False):
        engine = _engine(tiny_model, share)
        ids = [engine.submit(prompt, dataclasses.replace(keep, seed=s)) for s in range(2)]
        engine.run()
        second = engine.continue_request(ids[1], tool_output, dataclasses.replace(keep, seed=1))
        engine.run()
        turns.append([engine.completions[i] for i in (*ids, second)])
    for got, want in zip(*turns):
        _same(got, want)


def test_no_copy_across_a_weight_update(tiny_model):
    """After new weights, a prompt held under the old ones is prefilled again: the new request
    samples what the new weights give, while the held slot keeps decoding."""
    prompt = _prompt(tiny_model, 10, seed=4)
    new_model = init_model(tiny_model.cfg, seed=5)
    long = dataclasses.replace(SAMPLED, max_new_tokens=12, seed=0)
    engine = _engine(tiny_model, True)
    engine.submit(prompt, long)
    engine.step()
    engine.update_weights(nnx.split(new_model)[1], version=1, recompute_cache=False)
    before = engine.prefilled_rows
    params = dataclasses.replace(SAMPLED, seed=1)
    late = engine.submit(prompt, params)
    engine.run()
    assert engine.prefilled_rows == before + 1
    tokens, _, raw = recompute_generate(new_model, prompt, params, MAX_LEN)
    assert engine.completions[late].tokens == tokens
    np.testing.assert_allclose(engine.completions[late].raw_logprobs, raw, atol=1e-4)


def test_copies_between_slots_of_a_sharded_cache(tiny_model):
    """Eight slots split over 8 devices: a copy moves a row between devices and gives what the
    engine without sharing gives."""
    mesh = mesh_lib.make_mesh(MeshConfig(), jax.devices()[:8])
    prompt = _prompt(tiny_model, 9, seed=6)
    requests = [(prompt, dataclasses.replace(SAMPLED, seed=s)) for s in range(8)]
    shared = _engine(tiny_model, True, num_slots=8, mesh=mesh)
    plain = _engine(tiny_model, False, num_slots=8, mesh=mesh)
    for got, want in zip(_play(shared, requests), _play(plain, requests)):
        _same(got, want)
    assert shared.prefilled_rows == 1 and plain.prefilled_rows == 8
