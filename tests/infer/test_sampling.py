"""The engine's sampler draws from the full-forward model distribution (temperature, top-p)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.infer import InferenceEngine, SamplingParams, recompute_generate
from composer_jax.infer.sampling import sampling_log_probs
from tests.infer.conftest import (
    DRAWS,
    PROMPT,
    VOCAB,
    chi_square_p_value,
    joint_probs,
)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampled_pairs_follow_model_distribution(small_vocab_model, temperature, top_p):
    """Chi-square on the joint of the first two tokens (the second one decoded from the cache);
    the reported sampling log-prob is that of the nucleus distribution."""
    engine = InferenceEngine(
        small_vocab_model, num_slots=64, max_len=16, prefill_buckets=(8,), prefill_batch_sizes=(64,)
    )
    params = [
        SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=2, seed=s)
        for s in range(DRAWS)
    ]
    completions = [engine.completions[engine.submit(PROMPT, p)] for p in params]
    engine.run()
    pairs = np.asarray([c.tokens for c in completions])
    probs = joint_probs(small_vocab_model, temperature, top_p)
    counts = np.zeros((VOCAB, VOCAB))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    assert chi_square_p_value(counts.ravel(), probs.ravel()) > 1e-3
    assert probs[pairs[:, 0], pairs[:, 1]].min() > 0  # nothing outside the nucleus
    logprobs = np.asarray([c.logprobs for c in completions]).sum(-1)
    np.testing.assert_allclose(logprobs, np.log(probs[pairs[:, 0], pairs[:, 1]]), atol=1e-4)
    for params_i, completion in zip(params[:4], completions):
        tokens, _, _ = recompute_generate(small_vocab_model, PROMPT, params_i, max_len=16)
        assert completion.tokens == tokens  # same key -> same draw as the full-forward sampler


def test_chi_square_rejects_a_wrong_distribution():
    rng = np.random.default_rng(0)
    probs = np.full(VOCAB, 1 / VOCAB)
    counts = np.bincount(rng.choice(VOCAB, DRAWS, p=probs), minlength=VOCAB)
    assert chi_square_p_value(counts, probs) > 1e-3
    skewed = probs * np.linspace(0.5, 1.5, VOCAB)
    assert chi_square_p_value(counts, skewed / skewed.sum()) < 1e-3


def test_a_row_without_nucleus_keeps_every_token_whatever_its_batch_mates():
    """top_p 1 means no truncation, in the sort-free branch (all rows at 1) and in the nucleus
    branch (a batch-mate below 1) alike: the row's distribution does not depend on the batch."""
    # A wide spread of logits, so the tail's cumulative mass rounds to 1 in float32.
    logits = jax.random.normal(jax.random.key(3), (2, 259)) * 12.0
    temperature = jnp.array([1.0, 1.0])
    alone = sampling_log_probs(logits[:1], temperature[:1], jnp.array([1.0]))
    mixed = sampling_log_probs(logits, temperature, jnp.array([1.0, 0.5]))
    np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(mixed[0]))
    np.testing.assert_allclose(
        np.asarray(alone[0]), np.asarray(jax.nn.log_softmax(logits[0])), rtol=1e-5, atol=1e-5
    )
    assert np.isinf(np.asarray(mixed[1])).any()  # the batch-mate is truncated
