"""KL(pi || pi_ref) estimators from sampled tokens, and the exact per-position KL from logits.

With the log ratio l = log pi(y) - log pi_ref(y), y ~ pi: k1 = l (unbiased, high variance, can be
negative), k2 = l^2 / 2 (biased, low variance), k3 = (r - 1) - log r with r = pi_ref / pi
(unbiased, non-negative, low variance while the policies are close). Where they enter the
objective matters more than which one is used: see `composer_jax.rl.loss`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kl_estimate(logp: jax.Array, ref_logp: jax.Array, estimator: str) -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from the sampled token's log-probs."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * jnp.square(log_ratio)
    if estimator == "k3":
        return jnp.expm1(-log_ratio) + log_ratio  # (r - 1) - log r, stable for r near 1
    raise ValueError(f"unknown KL estimator {estimator!r}")


def exact_kl(logits_V: jax.Array, ref_logits_V: jax.Array) -> jax.Array:
    """KL(softmax(logits) || softmax(ref_logits)) over the last axis, in float32."""
    logp = jax.nn.log_softmax(logits_V.astype(jnp.float32), axis=-1)
    ref_logp = jax.nn.log_softmax(ref_logits_V.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(logp) * (logp - ref_logp), axis=-1)
