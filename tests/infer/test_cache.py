"""Latent cache + absorbed decode against recomputing the full training forward every step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from composer_jax.infer import (
    InferenceEngine,
    SamplingParams,
    cache_bytes_per_token,
    full_kv_bytes_per_token,
    recompute_generate,
)
from composer_jax.model.transformer import init_model
from tests.infer.conftest import YARN, model_config

MAX_LEN = 48
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


def _prompts(cfg, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, size=n).tolist() for n in lengths]


@pytest.mark.parametrize(
    "overrides, absorbed",
    [
        (dict(q_lora_rank=32), True),
        (dict(q_lora_rank=None, rope_scaling=YARN), True),
        (dict(q_lora_rank=32), False),
    ],
    ids=["q_lora", "no_q_lora_yarn", "q_lora_expanded"],
)
def test_greedy_decode_matches_full_recompute(overrides, absorbed):
    """Same tokens and log-probs (1e-4) as re-running the training forward at every step; the
    13-token prompt is prefilled in two chunks, the others share one batched prefill."""
    cfg = model_config(**overrides)
    m = init_model(cfg, seed=1)
    engine = InferenceEngine(
        m,
        num_slots=4,
        max_len=MAX_LEN,
        prefill_buckets=(8,),
        prefill_batch_sizes=(4,),
        absorbed=absorbed,
    )
    prompts = _prompts(cfg, (3, 7, 13))
    completions = engine.generate(prompts, GREEDY)
    for prompt, got in zip(prompts, completions):
        tokens, logprobs, raw = recompute_generate(m, prompt, GREEDY, MAX_LEN)
        assert got.tokens == tokens
        np.testing.assert_allclose(got.raw_logprobs, raw, atol=1e-4)
        assert got.logprobs == logprobs == [0.0] * len(tokens)  # greedy: a point mass
        assert got.finish_reason == "length"


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
def test_decode_over_cache_spans_matches_full_recompute(absorbed):
    """Each decode call attends over the shortest span covering its slots' positions plus the
    call's steps; rows cross the 16 and 32 boundaries mid-call and the spans change as they do:
    same tokens and log-probs as re-running the training forward."""
    cfg = model_config(q_lora_rank=32)
    m = init_model(cfg, seed=3)
    engine = InferenceEngine(
        m,
        num_slots=3,
        max_len=MAX_LEN,
        prefill_buckets=(8,),
        absorbed=absorbed,
        decode_chunk=3,
        decode_spans=(8, 16, 32),
    )
    spans = []
    run_decode = engine._run_decode
    engine._run_decode = lambda running, span: spans.append(span) or run_decode(running, span)
    params = dataclasses.replace(GREEDY, max_new_tokens=30)
    prompts = _prompts(cfg, (3, 7, 13), seed=4)
    for prompt, got in zip(prompts, engine.generate(prompts, params)):
        tokens, _, raw = recompute_generate(m, prompt, params, MAX_LEN)
        assert got.tokens == tokens
        np.testing.assert_allclose(got.raw_logprobs, raw, atol=1e-4)
    assert engine.decode_spans == (8, 16, 32, MAX_LEN)
    assert spans == sorted(spans) and set(spans) == {16, 32, MAX_LEN}


def test_cache_holds_only_latents(tiny_model):
    cfg = tiny_model.cfg
    engine = InferenceEngine(tiny_model, num_slots=2, max_len=32)
    per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.num_layers * 4
    assert cache_bytes_per_token(cfg) == per_token
    cache_bytes = sum(a.nbytes for a in engine.cache)
    assert cache_bytes == per_token * 2 * 32
    assert full_kv_bytes_per_token(cfg) == cfg.num_heads * (24 + 16) * cfg.num_layers * 4
    assert cache_bytes_per_token(cfg) * 4 <= full_kv_bytes_per_token(cfg)
