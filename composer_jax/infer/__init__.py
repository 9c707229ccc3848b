"""Inference engine for rollouts: MLA latent KV cache, continuous batching, speculative decoding."""

from composer_jax.infer.cache import (
    LatentCache,
    cache_bytes_per_token,
    full_kv_bytes_per_token,
    init_cache,
)
from composer_jax.infer.completion import Completion
from composer_jax.infer.engine import InferenceEngine
from composer_jax.infer.reference import recompute_generate
from composer_jax.infer.sampling import SamplingParams, sampling_log_probs
from composer_jax.infer.speculative import SpeculativeStats, speculative_generate
from composer_jax.infer.text import generate

__all__ = [
    "Completion",
    "InferenceEngine",
    "LatentCache",
    "SamplingParams",
    "SpeculativeStats",
    "cache_bytes_per_token",
    "full_kv_bytes_per_token",
    "generate",
    "init_cache",
    "recompute_generate",
    "sampling_log_probs",
    "speculative_generate",
]
