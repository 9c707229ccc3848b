"""MTP speculative decoding: greedy outputs identical, sampled distribution unchanged."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.infer import InferenceEngine, SamplingParams, recompute_generate
from composer_jax.infer.speculative import speculative_generate
from composer_jax.model.transformer import compute_logits, init_model
from tests.infer.conftest import (
    DRAWS,
    PROMPT,
    VOCAB,
    chi_square_p_value,
    joint_probs,
    model_config,
    nucleus,
)


def test_greedy_speculative_equals_plain_decoding(tiny_model):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tiny_model.cfg.vocab_size, size=n).tolist() for n in (4, 9, 6)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    engine = InferenceEngine(
        tiny_model, num_slots=4, max_len=48, prefill_buckets=(8,), prefill_batch_sizes=(4,)
    )
    plain = engine.generate(prompts, params)
    spec, stats = speculative_generate(
        tiny_model, prompts, [params] * 3, max_len=48, prompt_bucket=16
    )
    print(f"greedy acceptance rate (untrained MTP): {stats.acceptance_rate:.3f}")
    for want, got in zip(plain, spec):
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.raw_logprobs, want.raw_logprobs, atol=1e-4)
        np.testing.assert_array_equal(np.stack(got.experts), np.stack(want.experts))
    assert stats.drafted > 0 and stats.steps < 3 * 12


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_speculative_sampling_keeps_the_distribution(small_vocab_model, temperature, top_p):
    """Chi-square on the joint of tokens 1-2 (token 2 is an accepted draft or a residual draw)
    and on the marginal of token 3 (a bonus token or the next step's), against the main
    model's distribution at the temperature and top-p asked (the draft's and the target's
    both tempered and truncated)."""
    params = [
        SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=3, seed=s)
        for s in range(DRAWS)
    ]
    spec, stats = speculative_generate(
        small_vocab_model, [PROMPT] * DRAWS, params, max_len=16, prompt_bucket=8
    )
    print(f"sampling acceptance rate (untrained MTP, V={VOCAB}): {stats.acceptance_rate:.3f}")
    assert 0.05 < stats.acceptance_rate < 0.95  # both branches are exercised
    tokens = np.asarray([c.tokens for c in spec])
    probs = joint_probs(small_vocab_model, temperature, top_p)
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (tokens[:, 0], tokens[:, 1]), 1)
    assert chi_square_p_value(counts.ravel(), probs.ravel()) > 1e-3
    prefixes = np.asarray([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)], np.int32)
    logits = np.asarray(compute_logits(small_vocab_model, prefixes))[:, -1]
    third = np.stack([nucleus(row, temperature, top_p) for row in logits])
    marginal = probs.ravel() @ third
    assert chi_square_p_value(np.bincount(tokens[:, 2], minlength=VOCAB), marginal) > 1e-3
    expected = np.log(probs[tokens[:, 0], tokens[:, 1]])
    got = np.asarray([c.logprobs[:2] for c in spec]).sum(-1)
    np.testing.assert_allclose(got, expected, atol=1e-4)


def _bigram_with_exact_mtp(model):
    """Zeroes every residual-branch output so the main model predicts from the current token's
    embedding alone, and makes the MTP layer pass the next token's embedding through: its draft
    is then exactly the main model's next prediction."""
    zero = lambda p: p.set_value(jnp.zeros_like(p[...]))  # noqa: E731
    for stack in (model.dense_layers, model.moe_layers, model.mtp[0].block):
        zero(stack.attn.o_proj)
        zero(stack.mlp.down)
        if getattr(stack.mlp, "shared", None) is not None:
            zero(stack.mlp.shared.down)
    d = model.cfg.hidden_size
    model.mtp[0].proj.set_value(jnp.concatenate([jnp.zeros((d, d)), jnp.eye(d)]))
    return model


def test_exact_draft_is_always_accepted():
    """With a draft equal to the main model, every draft is accepted (two tokens per pass) and
    the output still equals plain decoding."""
    model = _bigram_with_exact_mtp(init_model(model_config(), seed=4))
    prompts = [[5, 6, 7], [9, 10, 11, 12], [1]]  # three rows: shares the greedy test's compile
    params = SamplingParams(temperature=0.0, max_new_tokens=9)
    spec, stats = speculative_generate(model, prompts, [params] * 3, max_len=48, prompt_bucket=16)
    assert stats.acceptance_rate == 1.0 and stats.steps == 4
    for prompt, got in zip(prompts, spec):
        want, _, raw = recompute_generate(model, prompt, params, max_len=48)
        assert got.tokens == want
        np.testing.assert_allclose(got.raw_logprobs, raw, atol=1e-4)
