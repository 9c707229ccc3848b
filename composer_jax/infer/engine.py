"""Rollout inference engine: continuous batching over slots of the MLA latent cache.

Each running sequence owns a cache slot. Between decode calls the host admits queued requests into
free slots (bucketed, batched prefill), decodes `decode_chunk` tokens for every running slot in one
fixed-shape call (stop sequences and budgets checked on device, `infer.decode`), and frees slots
whose request hit a stop sequence, a stop string or its token budget. A request submitted
with `keep_cache=True` parks its slot when it finishes, so `continue_request` can append tool output
and generate the next turn without prefilling the prefix again. Weights can be swapped between
calls (`update_weights`); every token records the policy version that sampled it.

Shapes seen by the compiler: decode is `decode_chunk` steps of [num_slots, 1] attending over one
of `decode_spans` cache lengths (the shortest covering every running slot: a step's cost grows
with the length it attends over, not the cache's size), with a stop-sequence table of one size
unless a request has many or long stop sequences; prefill chunks are [batch bucket (power of two
<= num_slots), length bucket] attending over no cached positions (fresh prompts) or over all,
so nothing recompiles per request.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Callable, ContextManager

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.data.tokenizer import Tokenizer, cached_tokenizer
from composer_jax.infer.cache import (
    cache_sharding,
    copy_slot,
    init_cache,
    new_cache,
)
from composer_jax.infer.completion import Completion, ends_with_stop_string, finish_reason
from composer_jax.infer.decode import REASONS, DecodeChunk, DecodeInputs, decode_chunk, stop_tables
from composer_jax.infer.forward import prefill_chunk
from composer_jax.infer.sampling import Sampled, SamplingParams
from composer_jax.model.transformer import Transformer
from composer_jax.parallel.mesh import committed_alike
from composer_jax.trace import NULL_TRACER

# The shortest cache length a decode call attends over by default; shorter spans save little
# next to the weights every step reads, and each costs a compile.
MIN_DECODE_SPAN = 128


@dataclasses.dataclass
class _Slot:
    request_id: int
    params: SamplingParams
    context: list[int]  # the whole sequence; the cache holds context[:length]
    length: int = 0
    feed: list[int] = dataclasses.field(default_factory=list)  # still to prefill
    emit: bool = True  # sample this turn's first token once the feed is consumed
    unrecorded: int = 0  # leading feed tokens that only rebuild the cache (no experts recorded)
    parked: bool = False
    # Routed experts of the cached positions [0, len) of the slot's first prompt under the
    # current weights: what another request with the same prompt may copy with the latents.
    prefix_experts: list[np.ndarray] = dataclasses.field(default_factory=list)
    # The first decode step feeds the prompt's last token (the rest was copied from a slot
    # holding the same prompt); its experts complete prompt_experts.
    last_prompt_in_decode: bool = False


class InferenceEngine:
    """Continuous-batching sampler over a fixed pool of cache slots.

    `mesh`: place the cache with its slots split over every mesh axis (num_slots must divide by
    the device count) and the weights replicated
    (or by `param_shardings`, a pytree of shardings matching the model state).
    `trace_context`: entered around every jitted call, e.g. `lambda: use_layout(layout)` so the
    model's MoE takes its expert-parallel path while the step is traced.
    `prefill_buckets` / `prefill_batch_sizes`: the chunk lengths and row counts prefill pads to
    (default row counts: powers of two up to num_slots); each pair compiles once for fresh
    prompts and once for chunks that read the cache.
    `absorbed`: decode and prefill in latent space (`absorbed_attend`) instead of expanding K/V.
    `tokenizer`: decodes turns for `SamplingParams.stop_strings` (else the params name one).
    `tracer`: records prefill chunks, decode calls and the host work after them
    (`composer_jax.trace`); the attribute may be replaced later.
    `decode_spans`: the cache lengths a decode call may attend over, each compiled once (default:
    doubling from `MIN_DECODE_SPAN` below max_len, and max_len).
    `decode_chunk`: decode steps per jitted call (one host sync per call). Larger chunks cut the
    per-token dispatch and host work; a slot freed mid-chunk waits for the chunk's end to take
    the next queued request, and a weight update lands only between chunks.
    `share_prefixes`: a new request whose prompt another slot already holds under the current
    weights (the samples of one RL group) copies that slot's cached latents and routed experts
    instead of prefilling them, and feeds only the prompt's last token, in its first decode step.
    """

    def __init__(
        self,
        model: Transformer,
        num_slots: int = 8,
        max_len: int = 512,
        prefill_buckets: tuple[int, ...] = (16, 64, 256),
        prefill_batch_sizes: tuple[int, ...] | None = None,
        absorbed: bool = True,
        version: int = 0,
        mesh: Mesh | None = None,
        param_shardings=None,
        trace_context: Callable[[], ContextManager] | None = None,
        tokenizer: Tokenizer | None = None,
        tracer=NULL_TRACER,
        decode_chunk: int = 1,
        share_prefixes: bool = True,
        decode_spans: tuple[int, ...] | None = None,
    ):
        if decode_chunk < 1:
            raise ValueError(f"decode_chunk={decode_chunk} must be >= 1")
        if decode_spans is None:
            decode_spans = tuple(MIN_DECODE_SPAN << i for i in range(max_len.bit_length()))
        self.decode_spans = tuple(sorted({s for s in decode_spans if 0 < s < max_len} | {max_len}))
        self.cfg = model.cfg
        self.decode_chunk = decode_chunk
        self.share_prefixes = share_prefixes
        self.tokenizer, self.tracer = tokenizer, tracer
        self.num_slots, self.max_len = num_slots, max_len
        self.buckets = tuple(sorted(b for b in prefill_buckets if b <= max_len)) or (max_len,)
        if prefill_batch_sizes is None:
            prefill_batch_sizes = tuple(1 << i for i in range(num_slots.bit_length()))
        sizes = {b for b in prefill_batch_sizes if b < num_slots} | {num_slots}
        self.batch_sizes = tuple(sorted(sizes))
        self.absorbed = absorbed
        self.mesh, self._param_shardings = mesh, param_shardings
        self._trace_context = trace_context or contextlib.nullcontext
        self.graphdef, state = nnx.split(model)
        state = self._place_params(state)
        self._cache_sharding = cache_sharding(mesh, state, num_slots)
        if self._cache_sharding is None:
            cache = init_cache(self.cfg, self.cfg.num_layers, num_slots, max_len)
        else:
            cache = new_cache(self.cfg, num_slots, max_len, self._cache_sharding)
        # Committed alike, or a loaded checkpoint's weights compile the first prefill twice.
        self.state, self.cache = committed_alike((state, cache))
        self.version = version
        self.completions: dict[int, Completion] = {}
        self._queue: collections.deque[_Slot] = collections.deque()
        self._slots: list[_Slot | None] = [None] * num_slots
        self._next_id = 0
        self._finished: list[int] = []  # requests finished since the last `step` returned

    # ------------------------------------------------------------------ public API

    def submit(self, prompt: list[int], params: SamplingParams = SamplingParams()) -> int:
        """Queues a request; it joins the running batch at the next `step`."""
        if not 0 < len(prompt) < self.max_len:
            raise ValueError(f"prompt length {len(prompt)} must be in [1, max_len={self.max_len})")
        self._decoder(params)
        rid = self._new_completion(list(prompt), 0)
        experts = self.completions[rid].prompt_experts  # filled as the prompt is prefilled
        self._queue.append(
            _Slot(rid, params, list(prompt), feed=list(prompt), prefix_experts=experts)
        )
        return rid

    def continue_request(
        self, request_id: int, appended: list[int], params: SamplingParams = SamplingParams()
    ) -> int:
        """Next turn of a finished request that kept its cache: prefills only the previous turn's
        last token and `appended` (e.g. tool output), then generates. Returns the new turn's id."""
        index = self._slot_of(request_id)
        slot = self._slots[index]
        if slot is None or not slot.parked:
            raise ValueError(f"request {request_id} is not finished with keep_cache=True")
        self._decoder(params)
        feed = slot.context[slot.length :] + list(appended)
        if slot.length + len(feed) >= self.max_len:
            raise ValueError(f"continuation would exceed max_len={self.max_len}")
        rid = self._new_completion(feed, slot.length)
        self._slots[index] = _Slot(
            rid,
            params,
            slot.context + list(appended),
            slot.length,
            feed=feed,
            prefix_experts=slot.prefix_experts,  # the first prompt's cache is untouched
        )
        return rid

    def restart_request(
        self,
        request_id: int,
        keep: int,
        appended: list[int],
        params: SamplingParams = SamplingParams(),
    ) -> int:
        """A parked request starts over from its first `keep` tokens plus `appended`: the cached
        prefix is reused (self-summarisation restarts from the task prompt), later entries are
        overwritten as the new context is prefilled. Returns the new turn's id."""
        index = self._slot_of(request_id)
        slot = self._slots[index]
        if slot is None or not slot.parked:
            raise ValueError(f"request {request_id} is not finished with keep_cache=True")
        if not 0 < keep <= slot.length:
            raise ValueError(f"keep={keep} must lie in [1, {slot.length}] (the cached tokens)")
        if keep + len(appended) >= self.max_len:
            raise ValueError(f"restart would exceed max_len={self.max_len}")
        self._decoder(params)
        rid = self._new_completion(list(appended), keep)
        context = slot.context[:keep] + list(appended)
        self._slots[index] = _Slot(
            rid,
            params,
            context,
            keep,
            feed=list(appended),
            prefix_experts=slot.prefix_experts[:keep],
        )
        return rid

    def release(self, request_id: int) -> None:
        """Frees the slot a parked request holds."""
        self._slots[self._slot_of(request_id)] = None

    def update_weights(self, params, version: int, recompute_cache: bool = True) -> None:
        """Swaps in new weights between decode calls; running sequences keep their slots.

        `params`: a `Transformer` or its `nnx.State`. With `recompute_cache`, every held sequence's
        cached latents are recomputed under the new weights (so what follows is exactly what the
        new policy produces from that prefix); without it, old-policy latents are reused.
        """
        state = nnx.split(params)[1] if isinstance(params, nnx.Module) else params
        self.state, self.cache = committed_alike((self._place_params(state), self.cache))
        self.version = version
        for slot in self._slots:  # cached latents of the old weights are shared no more
            if slot is not None:
                slot.prefix_experts = []
        if recompute_cache:
            for slot in self._slots:
                if slot is not None and slot.length:
                    slot.feed = slot.context[: slot.length] + slot.feed
                    slot.unrecorded += slot.length
                    slot.length = 0
            self._prefill()

    def compile_all(self) -> None:
        """Compiles every prefill (length bucket x batch size) shape and the decode shape now,
        so serving never stops to compile (unless a request brings more than
        `decode.MIN_STOP_TABLE` stop sequences, or longer ones). Runs them on padding rows,
        which write nothing."""
        for bucket in self.buckets:
            for rows in self.batch_sizes:
                for span in (0, self.max_len):
                    self._run_padding(rows, bucket, span)
        for span in self.decode_spans:
            self._run_decode([None] * self.num_slots, span)
        if self.share_prefixes:
            self.cache = copy_slot(self.cache, 0, 0, self._cache_sharding)

    @property
    def has_work(self) -> bool:
        running = any(s is not None and not s.parked for s in self._slots)
        return bool(self._queue) or running

    def step(self) -> list[int]:
        """Admits queued requests, prefills, decodes up to `decode_chunk` tokens per running
        slot. Returns the ids of requests that finished during this step."""
        self._admit()
        self._prefill()
        self._decode()
        finished, self._finished = self._finished, []
        return finished

    def take_finished(self) -> list[int]:
        """Ids finished outside `step` (e.g. by the prefill of `update_weights`), now cleared."""
        finished, self._finished = self._finished, []
        return finished

    def run(self) -> dict[int, Completion]:
        while self.has_work:
            self.step()
        return self.completions

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        ids = [self.submit(p, params) for p in prompts]
        self.run()
        return [self.completions[i] for i in ids]

    # ------------------------------------------------------------------ internals

    def _decoder(self, params: SamplingParams):
        """What decodes a turn for the request's stop strings (None when it has none)."""
        if not params.stop_strings:
            return None
        if self.tokenizer is not None:
            return self.tokenizer.decode
        if params.tokenizer:
            return cached_tokenizer(params.tokenizer).decode
        raise ValueError(
            "stop_strings need a tokenizer: InferenceEngine(tokenizer=...) or "
            "SamplingParams(tokenizer=<its spec>)"
        )

    def _new_completion(self, prompt: list[int], start_position: int) -> int:
        rid = self._next_id
        self._next_id += 1
        self.completions[rid] = Completion(rid, prompt, start_position)
        return rid

    def _slot_of(self, request_id: int) -> int:
        for index, slot in enumerate(self._slots):
            if slot is not None and slot.request_id == request_id:
                return index
        raise KeyError(f"request {request_id} holds no slot")

    def _place_params(self, state: nnx.State) -> nnx.State:
        if self.mesh is None:
            return state
        shardings = self._param_shardings
        if shardings is None:
            shardings = jax.tree.map(lambda _: NamedSharding(self.mesh, P()), state)
        return jax.device_put(state, shardings)

    def _run_padding(self, rows: int, length: int, span: int) -> None:
        zeros = np.zeros((rows, length), np.int32)
        slot_ids = np.full((rows,), self.num_slots, np.int32)
        self._run(zeros, zeros, zeros.astype(bool), slot_ids, zeros[:, 0], [None] * rows, span)

    def _admit(self) -> None:
        for index in range(self.num_slots):
            if not self._queue:
                return
            if self._slots[index] is None:
                self._slots[index] = self._queue.popleft()

    def _run(self, tokens_BT, positions_BT, valid_BT, slot_ids_B, last_B, row_slots, span):
        """One `prefill_chunk` call over cache positions [0, span); `row_slots` gives each
        row's slot (None: padding row)."""
        B = len(row_slots)
        temperature = np.zeros((B,), np.float32)
        top_p = np.ones((B,), np.float32)
        seeds = np.zeros((B,), np.uint32)
        for row, slot in enumerate(row_slots):
            if slot is not None:
                temperature[row] = slot.params.temperature
                top_p[row] = slot.params.top_p
                seeds[row] = slot.params.seed
        args = (tokens_BT, positions_BT, valid_BT, slot_ids_B, last_B, temperature, top_p, seeds)
        with self._trace_context():
            drawn, experts, self.cache = prefill_chunk(
                self.graphdef,
                self.state,
                self.cache,
                *map(jnp.asarray, args),
                self.absorbed,
                self._cache_sharding,
                span,
            )
        return jax.device_get(drawn), np.asarray(experts)

    def _prefill(self) -> None:
        """Feeds every slot's pending tokens in bucketed chunks until all feeds are consumed
        (first copying the prompts other slots hold, when `share_prefixes`)."""
        while True:
            todo = [i for i, s in enumerate(self._slots) if s is not None and s.feed]
            if self.share_prefixes:
                todo = self._share_prefixes(todo)
            if not todo:
                return
            by_bucket: dict[int, list[int]] = collections.defaultdict(list)
            for index in todo:
                n = min(len(self._slots[index].feed), self.buckets[-1])
                by_bucket[next(b for b in self.buckets if b >= n)].append(index)
            for bucket, group in by_bucket.items():
                self._prefill_batch(bucket, group)

    def _share_prefixes(self, todo: list[int]) -> list[int]:
        """Slots in `todo` starting a prompt that another slot holds take its cache row and the
        experts of all but the prompt's last position; one whose prompt a slot is still
        prefilling waits for it. Returns the slots to prefill now."""
        prefill = []
        for index in todo:
            slot = self._slots[index]
            n = len(slot.feed) - 1  # positions to copy: the last one is decoded
            if slot.length or slot.unrecorded or not slot.emit or n < 1:
                prefill.append(index)
                continue
            prompt = slot.feed[:n]
            donor = self._holder_of(prompt, index)
            if donor is not None:
                with self.tracer.span("prefix_copy", "copy prefix"):
                    self.cache = copy_slot(self.cache, donor, index, self._cache_sharding)
                experts = self.completions[slot.request_id].prompt_experts
                experts.extend(self._slots[donor].prefix_experts[:n])
                slot.prefix_experts = experts
                slot.length, slot.feed, slot.emit = n, [], False
                slot.last_prompt_in_decode = True
            elif not any(self._slots[i].context[:n] == prompt for i in prefill):
                prefill.append(index)  # the first of its prompt; the others copy it next round
        return prefill

    def _holder_of(self, prompt: list[int], exclude: int) -> int | None:
        """A slot whose cache holds `prompt` (positions and experts) under the current weights."""
        n = len(prompt)
        for index, slot in enumerate(self._slots):
            if (
                slot is not None
                and index != exclude
                and slot.length >= n
                and len(slot.prefix_experts) >= n
                and slot.context[:n] == prompt
            ):
                return index
        return None

    def _prefill_batch(self, bucket: int, group: list[int]) -> None:
        B = next(b for b in self.batch_sizes if b >= len(group))
        tokens = np.zeros((B, bucket), np.int32)
        positions = np.zeros((B, bucket), np.int32)
        valid = np.zeros((B, bucket), bool)
        slot_ids = np.full((B,), self.num_slots, np.int32)  # padding rows: out of range
        last = np.zeros((B,), np.int32)
        row_slots: list[_Slot | None] = [None] * B
        for row, index in enumerate(group):
            slot = row_slots[row] = self._slots[index]
            piece = slot.feed[:bucket]
            tokens[row, : len(piece)] = piece
            positions[row] = slot.length + np.arange(bucket)
            valid[row, : len(piece)] = True
            slot_ids[row], last[row] = index, len(piece) - 1
        span = self._prefill_span(max(self._slots[index].length for index in group))
        with self.tracer.span("prefill", f"prefill {B}x{bucket}", rows=len(group), span=span):
            drawn, experts = self._run(tokens, positions, valid, slot_ids, last, row_slots, span)
        with self.tracer.span("emit", "after prefill"):
            for row, index in enumerate(group):
                slot = self._slots[index]
                n = int(valid[row].sum())
                slot.length += n
                slot.feed = slot.feed[n:]
                skip = min(slot.unrecorded, n)
                slot.unrecorded -= skip
                completion = self.completions[slot.request_id]
                completion.prompt_experts.extend(experts[:, row, skip:n].transpose(1, 0, 2))
                if not slot.feed and slot.emit:
                    slot.emit = False
                    self._emit(index, drawn, row, experts[:, row, n - 1])

    def _decode(self) -> None:
        running = [s if s is not None and not s.parked else None for s in self._slots]
        count = sum(s is not None for s in running)
        if not count:
            return
        start = time.perf_counter()
        chunk = self._run_decode(running, self._decode_span(running))
        sampled = int(chunk.live_NB.sum())
        self.tracer.complete(
            "decode", None, start, time.perf_counter(), running=count, tokens=sampled
        )
        with self.tracer.span("emit", "after decode"):
            for index, slot in enumerate(running):
                if slot is not None:
                    self._take_chunk(index, chunk)

    def _prefill_span(self, cached: int) -> int:
        """Cache positions a prefill chunk whose rows hold at most `cached` positions reads:
        none for fresh prompts (attention over their own tokens alone, not over an empty cache
        of max_len positions too), else all. Two spans, not the decode spans, so prefill shapes
        (and `compile_all`) only double: a prompt's later chunks and the next turns are the
        rarer chunks, and they read the cache once a chunk, not once a token."""
        return 0 if cached == 0 else self.max_len

    def _decode_span(self, running: list[_Slot | None]) -> int:
        """The shortest decode span holding every running slot's cached positions and the ones
        this call's steps add."""
        needed = max(s.length for s in running if s is not None) + self.decode_chunk
        return next(s for s in self.decode_spans if s >= min(needed, self.max_len))

    def _run_decode(self, running: list[_Slot | None], span: int) -> DecodeChunk:
        """One `decode_chunk` call over every slot (None: not generating) attending over cache
        positions [0, span), synced to the host."""
        B = self.num_slots
        stops, history = stop_tables(
            [
                (s.params, self.completions[s.request_id].tokens) if s is not None else None
                for s in running
            ]
        )
        inputs = DecodeInputs(
            tokens=np.zeros(B, np.int32),
            positions=np.zeros(B, np.int32),
            live=np.zeros(B, bool),
            temperature=np.zeros(B, np.float32),
            top_p=np.ones(B, np.float32),
            seeds=np.zeros(B, np.uint32),
            tokens_left=np.zeros(B, np.int32),
            context_left=np.zeros(B, np.int32),
            stops=stops,
            history=history,
        )
        for index, slot in enumerate(running):
            if slot is None:
                continue
            generated = len(self.completions[slot.request_id].tokens)
            inputs.tokens[index] = slot.context[slot.length]  # the last sampled token
            inputs.positions[index] = slot.length
            inputs.live[index] = True
            inputs.temperature[index] = slot.params.temperature
            inputs.top_p[index] = slot.params.top_p
            inputs.seeds[index] = slot.params.seed
            inputs.tokens_left[index] = slot.params.max_new_tokens - generated
            inputs.context_left[index] = self.max_len - len(slot.context)
        with self._trace_context():
            chunk, self.cache = decode_chunk(
                self.graphdef,
                self.state,
                self.cache,
                inputs,
                self.decode_chunk,
                self.absorbed,
                span,
                self._cache_sharding,
            )
        return jax.device_get(chunk)

    def _take_chunk(self, index: int, chunk: DecodeChunk) -> None:
        """Records what slot `index` sampled in a chunk, cut at the first stop string; finishes
        the slot if it is done (cache entries past a cut are never read: the next turn rewrites
        them)."""
        slot = self._slots[index]
        completion = self.completions[slot.request_id]
        count = int(chunk.live_NB[:, index].sum())
        if slot.last_prompt_in_decode:  # its first step fed the prompt's last position
            completion.prompt_experts.append(chunk.experts_NBLK[0, index])
            slot.last_prompt_in_decode = False
        tokens = chunk.token_NB[:count, index].tolist()
        reason = REASONS[int(chunk.reason_B[index])]
        decode = self._decoder(slot.params)
        if decode is not None:
            for n in range(1, count + 1):
                if ends_with_stop_string(completion.tokens + tokens[:n], slot.params, decode):
                    count, reason = n, "stop"
                    break
        completion.extend(
            tokens[:count],
            chunk.logprob_NB[:count, index].tolist(),
            chunk.raw_logprob_NB[:count, index].tolist(),
            self.version,
            chunk.experts_NBLK[:count, index],
        )
        slot.context.extend(tokens[:count])
        slot.length += count
        if reason is not None:
            self._finish(index, reason)

    def _emit(self, index: int, drawn: Sampled, row: int, experts_LK: np.ndarray) -> None:
        """Appends the token sampled after a prefill; finishes the slot if done."""
        slot = self._slots[index]
        completion = self.completions[slot.request_id]
        token = int(drawn.token_B[row])
        completion.record(
            token,
            float(drawn.logprob_B[row]),
            float(drawn.raw_logprob_B[row]),
            self.version,
            experts_LK,
        )
        slot.context.append(token)
        reason = finish_reason(completion.tokens, slot.params, self._decoder(slot.params))
        if reason is None and len(slot.context) >= self.max_len:
            reason = "max_len"
        if reason is not None:
            self._finish(index, reason)

    def _finish(self, index: int, reason: str) -> None:
        """Ends the slot's turn: parks the slot for a continuation or frees it."""
        slot = self._slots[index]
        self.completions[slot.request_id].finish_reason = reason
        self._finished.append(slot.request_id)
        if slot.params.keep_cache:
            slot.parked = True
        else:
            self._slots[index] = None
