"""The cache-free sampler: re-runs the training forward over the whole sequence for every token.

It is the ground truth the engine is tested against and the baseline the benchmark times. The
sequence is padded to a fixed length so the forward compiles once; causal masking makes the
padding invisible to the positions that are read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax.infer import sampling
from composer_jax.infer.sampling import SamplingParams
from composer_jax.model.transformer import Transformer


@functools.partial(jax.jit, static_argnums=0)
def _recompute_step(graphdef, state, tokens_BS, last_B, temperature_B, top_p_B, seeds_B):
    m = nnx.merge(graphdef, state)
    hidden_BSD = m(tokens_BS, with_mtp=False).hidden_BTD
    h_BD = hidden_BSD[jnp.arange(tokens_BS.shape[0]), last_B]
    logits_BV = m.logits(h_BD)
    keys = sampling.token_keys(seeds_B, last_B + 1)
    return sampling.sample(logits_BV, temperature_B, top_p_B, keys), logits_BV


def recompute_generate(
    model: Transformer, prompt: list[int], params: SamplingParams, max_len: int
) -> tuple[list[int], list[float], list[float]]:
    """(tokens, sampling log-probs, raw log-probs) for one prompt; max_new_tokens and stop
    sequences apply as in the engine."""
    graphdef, state = nnx.split(model)
    tokens = np.zeros((1, max_len), np.int32)
    tokens[0, : len(prompt)] = prompt
    length = len(prompt)
    out, logprobs, raw = [], [], []
    as_row = lambda v, dt: jnp.asarray([v], dt)  # noqa: E731
    while len(out) < params.max_new_tokens and length < max_len:
        drawn, _ = _recompute_step(
            graphdef,
            state,
            jnp.asarray(tokens),
            as_row(length - 1, jnp.int32),
            as_row(params.temperature, jnp.float32),
            as_row(params.top_p, jnp.float32),
            as_row(params.seed, jnp.uint32),
        )
        token = int(drawn.token_B[0])
        out.append(token)
        logprobs.append(float(drawn.logprob_B[0]))
        raw.append(float(drawn.raw_logprob_B[0]))
        tokens[0, length] = token
        length += 1
        if any(out[-len(s) :] == list(s) for s in params.stop_sequences if len(out) >= len(s)):
            break
    return out, logprobs, raw
