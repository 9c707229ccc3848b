"""The engine's sampler draws from the full-forward model distribution (temperature, top-p)."""

from __future__ import annotations

import numpy as np
import pytest

from composer_jax.infer import InferenceEngine, SamplingParams, recompute_generate
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
