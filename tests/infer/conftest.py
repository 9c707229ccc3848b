"""Tiny float32 models and the statistics helpers of the inference tests."""

from __future__ import annotations

import numpy as np
import pytest
from jax.scipy.stats import chi2

from composer_jax import config
from composer_jax.model.transformer import compute_logits, init_model
from tests.helpers import tiny_model_config

VOCAB = 16  # statistical tests: small vocabulary, fixed prompt, number of draws
PROMPT = [3, 1, 4, 1, 5]
DRAWS = 1024
YARN = config.YarnConfig(factor=4.0, original_max_position_embeddings=16, mscale_all_dim=0.8)


def model_config(**overrides) -> config.ModelConfig:
    """The tiny preset in float32 (one dense and one MoE layer, one MTP depth)."""
    return tiny_model_config(**overrides)


@pytest.fixture(scope="session")
def tiny_model():
    """The default tiny model (q_lora, no YaRN), shared by the engine tests."""
    return init_model(model_config(), seed=1)


def nucleus(logits_V: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Sampling probabilities written independently of the engine: the smallest set of most
    likely tokens whose mass reaches top_p, renormalised."""
    z = logits_V.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.cumsum(p[order]) - p[order] < top_p
    out = np.zeros_like(p)
    out[order[keep]] = p[order[keep]]
    return out / out.sum()


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square against `probs`, pooling cells expected below 5 into one."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = np.sum((obs - exp) ** 2 / exp)
    return float(chi2.sf(stat, len(obs) - 1))


@pytest.fixture(scope="session")
def small_vocab_model():
    """A 16-token vocabulary, so sampled distributions can be checked cell by cell."""
    return init_model(model_config(vocab_size=VOCAB), seed=3)


def joint_probs(model, temperature: float, top_p: float) -> np.ndarray:
    """P(first two generated tokens) [V, V] from the full forward."""
    first = np.asarray(compute_logits(model, np.asarray([PROMPT], np.int32)))[0, -1]
    rows = np.asarray([PROMPT + [t] for t in range(VOCAB)], np.int32)
    second = np.asarray(compute_logits(model, rows))[:, -1]
    p1 = nucleus(first, temperature, top_p)
    p2 = np.stack([nucleus(s, temperature, top_p) for s in second])
    return p1[:, None] * p2
