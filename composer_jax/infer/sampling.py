"""Sampling parameters and the per-row sampling distribution (temperature, then top-p).

Two log-probs are reported for every sampled token, because RL needs to say which policy it is
correcting for:
- `logprob`: under the distribution actually sampled from (logits / temperature, truncated to the
  top-p nucleus and renormalised; greedy rows put all mass on the argmax, so 0). This is the
  behaviour policy for importance weights.
- `raw_logprob`: log_softmax of the unmodified logits (the policy at temperature 1, no top-p).
  The RL trainer recomputes the tempered distribution (`composer_jax.rl.policy`), not this one.
Randomness is a pure function of (request seed, token position), so a request samples the same
tokens whatever else runs in the batch.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # token sequences that end generation
    # Texts that end generation once the decoded turn contains one (whatever tokens spell it);
    # decoded with the engine's tokenizer, else with `load_tokenizer(tokenizer)`.
    stop_strings: tuple[str, ...] = ()
    tokenizer: str = ""
    seed: int = 0
    keep_cache: bool = False  # hold the slot when finished so the request can be continued


class Sampled(NamedTuple):
    token_B: jax.Array  # int32
    logprob_B: jax.Array  # under the sampling distribution (see module docstring)
    raw_logprob_B: jax.Array  # under log_softmax(logits)


def sampling_log_probs(
    logits_BV: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array
) -> jax.Array:
    """Log-probs of the distribution tokens are drawn from ([B, V], -inf outside the nucleus)."""
    greedy_B1 = (temperature_B <= 0)[:, None]
    scaled = logits_BV / jnp.where(greedy_B1, 1.0, temperature_B[:, None])
    logp_BV = jax.nn.log_softmax(scaled, axis=-1)
    # Without a nucleus (every top_p 1, the RL default) the sort is skipped: on XLA:CPU it is
    # the largest single op of a decode step.
    kept_BV = jax.lax.cond(
        jnp.all(top_p_B >= 1.0),
        lambda: jnp.ones(logp_BV.shape, bool),
        lambda: _nucleus(logp_BV, top_p_B),
    )
    argmax_BV = jax.nn.one_hot(jnp.argmax(logits_BV, axis=-1), logits_BV.shape[-1], dtype=bool)
    kept_BV = jnp.where(greedy_B1, argmax_BV, kept_BV)
    masked_BV = jnp.where(kept_BV, logp_BV, -jnp.inf)
    return masked_BV - jax.nn.logsumexp(masked_BV, axis=-1, keepdims=True)


def _nucleus(logp_BV: jax.Array, top_p_B: jax.Array) -> jax.Array:
    """The smallest set of most likely tokens whose mass reaches top_p, per row; a row with top_p
    1 keeps every token (as the sort-free branch does, whatever its batch-mates ask for)."""
    sorted_BV = -jnp.sort(-logp_BV, axis=-1)
    mass_before_BV = jnp.cumsum(jnp.exp(sorted_BV), axis=-1) - jnp.exp(sorted_BV)
    in_nucleus_BV = mass_before_BV < top_p_B[:, None]  # the top token always qualifies
    cutoff_B1 = jnp.min(jnp.where(in_nucleus_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    return (logp_BV >= cutoff_B1) | (top_p_B >= 1.0)[:, None]


def token_keys(seeds_B: jax.Array, positions_B: jax.Array) -> jax.Array:
    """One key per row from (request seed, position of the token being sampled)."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds_B, positions_B)


def sample(
    logits_BV: jax.Array, temperature_B: jax.Array, top_p_B: jax.Array, keys_B: jax.Array
) -> Sampled:
    """Gumbel-max draw from `sampling_log_probs`, with both log-probs of the drawn token."""
    logp_BV = sampling_log_probs(logits_BV, temperature_B, top_p_B)
    gumbel_BV = jax.vmap(lambda k: jax.random.gumbel(k, logits_BV.shape[-1:]))(keys_B)
    token_B = jnp.argmax(logp_BV + gumbel_BV, axis=-1).astype(jnp.int32)
    raw_BV = jax.nn.log_softmax(logits_BV, axis=-1)
    pick = lambda a: jnp.take_along_axis(a, token_B[:, None], axis=-1)[:, 0]  # noqa: E731
    return Sampled(token_B, pick(logp_BV), pick(raw_BV))
