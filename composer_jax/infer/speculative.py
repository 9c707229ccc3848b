"""MTP speculative decoding with exact acceptance: the output distribution is the main model's.

The first MTP depth drafts one token per step; the main model verifies it in a two-token chunk.
With the last committed token x_n (not yet in the main cache) and main hidden state h_{n-1}:
1. MTP at position n-1 mixes h_{n-1} with embed(x_n) and gives the draft distribution q for
   x_{n+1}; draw y ~ q.
2. The main model runs [x_n, y] at positions [n, n+1], giving p_n (for x_{n+1}) and p_{n+1}.
3. Accept y with probability min(1, p_n(y) / q(y)) and then draw a bonus x_{n+2} ~ p_{n+1};
   otherwise draw x_{n+1} from normalise(max(0, p_n - q)). Either way x_{n+1} ~ p_n exactly
   (Leviathan et al. 2023), so sampling (and greedy) outputs are those of the main model.
p and q are the sampling distributions (temperature, top-p) of main model and MTP head; the
reported log-probs are under p, the distribution the tokens follow. The MTP layer keeps its own
latent cache layer: its entry at position s needs (h_s, x_{s+1}), so positions committed in a
step are fed to it at the start of the next step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax.infer import sampling
from composer_jax.infer.cache import LatentCache, init_cache
from composer_jax.infer.completion import Completion, finish_reason
from composer_jax.infer.forward import forward_chunk, mtp_chunk
from composer_jax.infer.sampling import Sampled, SamplingParams
from composer_jax.model.transformer import Transformer


class _State(NamedTuple):
    """Per-row decoding state, kept on device between steps."""

    token_B: jax.Array  # last committed token x_n, not yet in the main cache
    position_B: jax.Array  # n
    pending_hidden_BPD: jax.Array  # main hidden states whose MTP cache entry is missing
    pending_next_BP: jax.Array  # the token after each of them
    pending_position_BP: jax.Array
    pending_valid_BP: jax.Array  # valid entries come first; the last one drafts


class _StepOut(NamedTuple):
    tokens_B2: jax.Array  # x_{n+1}, then the bonus x_{n+2} (meaningful when accepted)
    accepted_B: jax.Array
    logprobs_B2: jax.Array
    raw_logprobs_B2: jax.Array
    experts_LB2K: jax.Array  # routing of the positions that produced the two tokens


@dataclasses.dataclass
class SpeculativeStats:
    drafted: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)


def _gumbel_argmax(logp_BV: jax.Array, keys_B: jax.Array) -> jax.Array:
    noise = jax.vmap(lambda k: jax.random.gumbel(k, logp_BV.shape[-1:]))(keys_B)
    return jnp.argmax(logp_BV + noise, axis=-1).astype(jnp.int32)


def _pick(a_BV: jax.Array, token_B: jax.Array) -> jax.Array:
    return jnp.take_along_axis(a_BV, token_B[:, None], axis=-1)[:, 0]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _prefill(graphdef, state, cache, tokens_BT, last_B, temperature_B, top_p_B, seeds_B):
    """Main model and MTP cache over the prompts; samples x_n. Returns (sample, experts, state)."""
    m = nnx.merge(graphdef, state)
    B, T = tokens_BT.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    valid = positions <= last_B[:, None]
    rows = jnp.arange(B)
    out = forward_chunk(m, cache, tokens_BT, positions, valid, rows, absorbed=True)
    logits_BV = m.logits(out.hidden_BTD[rows, last_B])
    drawn = sampling.sample(
        logits_BV, temperature_B, top_p_B, sampling.token_keys(seeds_B, last_B + 1)
    )
    next_tokens = jnp.roll(tokens_BT, -1, axis=1)
    _, cache = mtp_chunk(
        m,
        out.cache,
        out.hidden_BTD,
        next_tokens,
        positions,
        positions < last_B[:, None],
        rows,
        True,
    )
    hidden_B1D = out.hidden_BTD[rows, last_B][:, None]
    pending = _State(
        drawn.token_B,
        last_B + 1,
        jnp.concatenate([hidden_B1D, jnp.zeros_like(hidden_B1D)], axis=1),
        jnp.stack([drawn.token_B, drawn.token_B], axis=1),
        jnp.stack([last_B, last_B + 1], axis=1),
        jnp.stack([jnp.ones((B,), bool), jnp.zeros((B,), bool)], axis=1),
    )
    return drawn, out.experts_LBTK[:, rows, last_B], pending, cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _step(graphdef, state, cache, s: _State, active_B, temperature_B, top_p_B, seeds_B):
    """Draft with MTP, verify with the main model, accept exactly. Returns (out, state, cache)."""
    m = nnx.merge(graphdef, state)
    B = s.token_B.shape[0]
    rows = jnp.arange(B)
    mtp_valid = s.pending_valid_BP & active_B[:, None]
    mtp_hidden, cache = mtp_chunk(
        m,
        cache,
        s.pending_hidden_BPD,
        s.pending_next_BP,
        s.pending_position_BP,
        mtp_valid,
        rows,
        True,
    )
    last = jnp.sum(s.pending_valid_BP, axis=-1) - 1
    draft_logits_BV = m.head(mtp_hidden[rows, last])
    keys = jax.vmap(lambda k: jax.random.split(k, 4))(sampling.token_keys(seeds_B, s.position_B))
    q_logp = sampling.sampling_log_probs(draft_logits_BV, temperature_B, top_p_B)
    draft_B = _gumbel_argmax(q_logp, keys[:, 0])

    tokens_B2 = jnp.stack([s.token_B, draft_B], axis=1)
    positions_B2 = s.position_B[:, None] + jnp.arange(2)
    valid_B2 = jnp.broadcast_to(active_B[:, None], (B, 2))
    out = forward_chunk(m, cache, tokens_B2, positions_B2, valid_B2, rows, absorbed=True)
    logits_B2V = m.logits(out.hidden_BTD)
    V = logits_B2V.shape[-1]
    p_logp = sampling.sampling_log_probs(
        logits_B2V.reshape(2 * B, V), jnp.repeat(temperature_B, 2), jnp.repeat(top_p_B, 2)
    ).reshape(B, 2, V)
    p_now, q = jnp.exp(p_logp[:, 0]), jnp.exp(q_logp)
    u_B = jax.vmap(jax.random.uniform)(keys[:, 1])
    accepted_B = u_B * _pick(q, draft_B) < _pick(p_now, draft_B)
    residual = jnp.maximum(p_now - q, 0.0)
    residual_B = _gumbel_argmax(jnp.log(residual), keys[:, 2])
    bonus_B = _gumbel_argmax(p_logp[:, 1], keys[:, 3])
    next_B = jnp.where(accepted_B, draft_B, residual_B)

    raw_B2V = jax.nn.log_softmax(logits_B2V, axis=-1)
    emitted = (next_B, bonus_B)
    step_out = _StepOut(
        jnp.stack(emitted, axis=1),
        accepted_B,
        jnp.stack([_pick(p_logp[:, i], t) for i, t in enumerate(emitted)], axis=1),
        jnp.stack([_pick(raw_B2V[:, i], t) for i, t in enumerate(emitted)], axis=1),
        out.experts_LBTK,
    )
    new_state = _State(
        jnp.where(accepted_B, bonus_B, next_B),
        s.position_B + 1 + accepted_B,
        out.hidden_BTD,
        jnp.stack([next_B, bonus_B], axis=1),
        positions_B2,
        jnp.stack([jnp.ones((B,), bool), accepted_B], axis=1),
    )
    keep = lambda new, old: jnp.where(  # noqa: E731
        active_B.reshape((B,) + (1,) * (new.ndim - 1)), new, old
    )
    return step_out, jax.tree.map(keep, new_state, s), out.cache


def speculative_generate(
    model: Transformer,
    prompts: list[list[int]],
    params: list[SamplingParams],
    max_len: int,
    prompt_bucket: int = 64,
    version: int = 0,
) -> tuple[list[Completion], SpeculativeStats]:
    """Generates for a batch of prompts in lock step with MTP drafts. Prompts must fit in
    `prompt_bucket`; max_new_tokens and stop sequences apply per prompt as in the engine."""
    cfg = model.cfg
    if not cfg.num_mtp_layers:
        raise ValueError("speculative decoding needs a model with MTP layers")
    if max(len(p) for p in prompts) > prompt_bucket or prompt_bucket >= max_len:
        raise ValueError(f"prompts must fit prompt_bucket={prompt_bucket} < max_len={max_len}")
    graphdef, state = nnx.split(model)
    B = len(prompts)
    cache: LatentCache = init_cache(cfg, cfg.num_layers + 1, B, max_len)
    tokens = np.zeros((B, prompt_bucket), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    temperature = jnp.asarray([p.temperature for p in params], jnp.float32)
    top_p = jnp.asarray([p.top_p for p in params], jnp.float32)
    seeds = jnp.asarray([p.seed for p in params], jnp.uint32)
    last = jnp.asarray([len(p) - 1 for p in prompts], jnp.int32)
    drawn, experts, s, cache = _prefill(
        graphdef, state, cache, jnp.asarray(tokens), last, temperature, top_p, seeds
    )
    completions = [Completion(i, list(p), 0) for i, p in enumerate(prompts)]
    drawn, experts = jax.device_get((drawn, experts))
    active = np.asarray(
        [
            not _record(completions[row], params[row], version, drawn, experts[:, row], row)
            for row in range(B)
        ]
    )
    stats = SpeculativeStats()
    while active.any():
        too_long = np.asarray(s.position_B) + 2 > max_len
        for row in np.flatnonzero(active & too_long):
            completions[row].finish_reason = "max_len"
            active[row] = False
        if not active.any():
            break
        out, s, cache = _step(
            graphdef, state, cache, s, jnp.asarray(active), temperature, top_p, seeds
        )
        out = jax.device_get(out)
        stats.steps += 1
        stats.drafted += int(active.sum())
        stats.accepted += int((out.accepted_B & active).sum())
        for i in range(2):  # x_{n+1} for every row, then the bonus token where accepted
            emitted = Sampled(out.tokens_B2[:, i], out.logprobs_B2[:, i], out.raw_logprobs_B2[:, i])
            for row in np.flatnonzero(active & (out.accepted_B | (i == 0))):
                experts_LK = out.experts_LB2K[:, row, i]
                active[row] = not _record(
                    completions[row], params[row], version, emitted, experts_LK, row
                )
    return completions, stats


def _record(completion, params, version, drawn: Sampled, experts_LK, row: int) -> bool:
    """Appends row `row` of `drawn` to its completion; True when the request is done."""
    completion.record(
        int(drawn.token_B[row]),
        float(drawn.logprob_B[row]),
        float(drawn.raw_logprob_B[row]),
        version,
        experts_LK,
    )
    completion.finish_reason = finish_reason(completion.tokens, params)
    return completion.finish_reason is not None
