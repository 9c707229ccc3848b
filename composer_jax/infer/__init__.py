"""Inference engine for rollouts: batched sampler with MLA KV cache (to come)."""
