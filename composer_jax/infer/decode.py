"""Several decode steps in one jitted call, with the stop checks on device.

Each step feeds every live slot its last sampled token, samples the next one and decides on device
whether the row is done: it ended with one of its stop sequences, spent its token budget, or filled
its cache row. The call ends after `steps` steps or after the first step in which a row finished
(so the host can give that slot its next request without the other rows idling it), and the host
syncs once per call, reading the per-token records as [steps, slots, ...] arrays whose entries
past a row's end are masked. A finished row stops writing (its input is marked invalid, so its
cache row and length stay where they were). Stop strings need decoded text and are checked by the
host after the call.

Inputs of rows that are not live are the ones a single decode step gives them (token 0 at position
0, invalid), and each token's key depends only on (request seed, position), so a chunk of N steps
samples exactly what N single steps sample.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from composer_jax.infer import sampling
from composer_jax.infer.cache import LatentCache
from composer_jax.infer.forward import forward_chunk
from composer_jax.infer.sampling import SamplingParams
from composer_jax.parallel.mesh import pinned

# Finish reasons by the code a chunk returns per row (0: still running).
REASONS = (None, "stop", "length", "max_len")
_STOP, _LENGTH, _MAX_LEN = 1, 2, 3

# Stop tables hold each row's stop sequences right-aligned in [stops, width]; entries left of a
# sequence match anything, unused stop rows match nothing. A row's history holds its turn's last
# `width` tokens right-aligned, padded where the turn has fewer tokens (which no stop entry equals).
_ANY_TOKEN = -1
_BEFORE_TURN = -2
_UNUSED_STOP = -3


class DecodeInputs(NamedTuple):
    """Per-slot state at the start of a chunk ([B] unless noted)."""

    tokens: np.ndarray  # the last sampled token, fed at the first step
    positions: np.ndarray  # its position (the cached length)
    live: np.ndarray  # bool: the slot is generating
    temperature: np.ndarray
    top_p: np.ndarray
    seeds: np.ndarray
    tokens_left: np.ndarray  # tokens the turn may still sample
    context_left: np.ndarray  # tokens that still fit in the cache row
    stops: np.ndarray  # [B, stops, width], see the sentinels above
    history: np.ndarray  # [B, width]


class DecodeChunk(NamedTuple):
    """What a chunk sampled, step-major; entries where `live_NB` is False are to be ignored."""

    token_NB: jax.Array
    logprob_NB: jax.Array  # under the sampling distribution
    raw_logprob_NB: jax.Array  # under log_softmax(logits)
    experts_NBLK: jax.Array  # routed experts of the position that produced each token
    live_NB: jax.Array  # the row sampled this token
    reason_B: jax.Array  # index into REASONS: why the row stopped (0: still running)


# Stop tables are at least this many sequences of this many tokens, so the usual requests (a few
# stop tokens) share the one decode shape `InferenceEngine.compile_all` compiles.
MIN_STOP_TABLE = 4


def _bucket(n: int) -> int:
    """The power of two >= n, at least MIN_STOP_TABLE, so stop tables compile few shapes."""
    return max(MIN_STOP_TABLE, 1 << max(n - 1, 0).bit_length())


def stop_tables(
    rows: list[tuple[SamplingParams, list[int]] | None],
) -> tuple[np.ndarray, np.ndarray]:
    """Stop tables [B, stops, width] and turn histories [B, width] for rows given as (params,
    tokens generated so far this turn), None for rows that are not live."""
    sequences = [[s for s in row[0].stop_sequences if s] if row else [] for row in rows]
    count = _bucket(max(map(len, sequences), default=0))
    width = _bucket(max((len(s) for seqs in sequences for s in seqs), default=1))
    stops = np.full((len(rows), count, width), _UNUSED_STOP, np.int32)
    history = np.full((len(rows), width), _BEFORE_TURN, np.int32)
    for b, (row, seqs) in enumerate(zip(rows, sequences)):
        for i, seq in enumerate(seqs):
            stops[b, i] = _ANY_TOKEN
            stops[b, i, width - len(seq) :] = seq
        if row is not None:
            recent = row[1][-width:]
            history[b, width - len(recent) :] = recent
    return stops, history


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7), donate_argnums=(2,))
def decode_chunk(
    graphdef,
    state,
    cache: LatentCache,
    inputs: DecodeInputs,
    steps: int,
    absorbed: bool,
    span: int,
    cache_sharding: NamedSharding | None = None,
) -> tuple[DecodeChunk, LatentCache]:
    """`steps` decode steps over all slots (row b is cache slot b), attending over cache positions
    [0, span): it must exceed every live row's position + steps - 1; the cache comes back laid
    out by `cache_sharding` (None: as the compiler chooses). See the module docstring."""
    m = nnx.merge(graphdef, state)

    def step(carry, _):
        cache, token_B, position_B, live_B, history_BL, tokens_left_B, context_left_B, reason_B = (
            carry
        )
        out = forward_chunk(
            m,
            cache,
            jnp.where(live_B, token_B, 0)[:, None],
            jnp.where(live_B, position_B, 0)[:, None],
            live_B[:, None],
            None,
            absorbed,
            span,
        )
        logits_BV = m.logits(out.hidden_BTD[:, 0])
        keys = sampling.token_keys(inputs.seeds, jnp.where(live_B, position_B, 0) + 1)
        drawn = sampling.sample(logits_BV, inputs.temperature, inputs.top_p, keys)
        shifted_BL = jnp.concatenate([history_BL[:, 1:], drawn.token_B[:, None]], axis=1)
        history_BL = jnp.where(live_B[:, None], shifted_BL, history_BL)
        tokens_left_B = tokens_left_B - live_B
        context_left_B = context_left_B - live_B
        ended_B = _ended(inputs.stops, history_BL, tokens_left_B, context_left_B)
        reason_B = jnp.where(live_B, ended_B, reason_B)
        record = (
            drawn.token_B,
            drawn.logprob_B,
            drawn.raw_logprob_B,
            out.experts_LBTK[:, :, 0].transpose(1, 0, 2),
            live_B,
        )
        carry = (
            out.cache,
            jnp.where(live_B, drawn.token_B, token_B),
            position_B + live_B,
            live_B & (ended_B == 0),
            history_BL,
            tokens_left_B,
            context_left_B,
            reason_B,
        )
        return carry, record

    carry = (
        cache,
        inputs.tokens,
        inputs.positions,
        inputs.live,
        inputs.history,
        inputs.tokens_left,
        inputs.context_left,
        jnp.zeros_like(inputs.tokens),
    )
    records, carry = _until_a_row_ends(step, carry, steps)
    return DecodeChunk(*records, carry[-1]), pinned(carry[0], cache_sharding)


def _ended(stops, history_BL, tokens_left_B, context_left_B) -> jax.Array:
    """Why each row ends after this step (0: it goes on): a stop sequence matched at the end of
    its history, its token budget spent, or the context full."""
    matched_BSL = (stops == _ANY_TOKEN) | (stops == history_BL[:, None, :])
    stopped_B = jnp.all(matched_BSL, axis=-1).any(axis=-1)
    return jnp.select(
        [stopped_B, tokens_left_B <= 0, context_left_B <= 0], [_STOP, _LENGTH, _MAX_LEN], 0
    )


def _until_a_row_ends(step, carry, steps: int):
    """(records of each step, the last carry) of `step` run at most `steps` times. A while loop
    rather than a scan: the call ends at the first step in which a row finishes (carry[-1], its
    reason, set) or none is live (carry[3]), so its slot is refilled by the host at once instead
    of idling to the end of the chunk. Records of steps not run stay zero with `live` False,
    which the host skips."""
    shapes = jax.eval_shape(lambda c: step(c, None)[1], carry)
    buffers = jax.tree.map(lambda x: jnp.zeros((steps, *x.shape), x.dtype), shapes)

    def running(loop):
        i, carry, _ = loop
        live_B, reason_B = carry[3], carry[-1]
        return (i < steps) & live_B.any() & ~(reason_B != 0).any()

    def body(loop):
        i, carry, buffers = loop
        carry, record = step(carry, None)
        buffers = jax.tree.map(lambda buf, r: buf.at[i].set(r), buffers, record)
        return i + 1, carry, buffers

    _, carry, records = jax.lax.while_loop(running, body, (0, carry, buffers))
    return records, carry
