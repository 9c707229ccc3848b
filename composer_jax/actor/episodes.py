"""The episode driver: one sample's way through the sampler and its environment.

Per sample: start its episode, submit its prompt when the environment has it, hand each finished
turn to the environment, append the tool output and continue the request (cache kept), run the
feedback detectors on the turn, ask for a summary when the generation reaches `summary_budget`
(the next generation restarts from task + summary, reusing the cached prompt), start over when
its environment worker fails (at most MAX_ATTEMPTS times), and score it. The coordinator owns
the shared state (`RolloutState`) and decides what happens when a group is complete.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import zlib
from collections.abc import Callable

import numpy as np

from composer_jax.actor import feedback
from composer_jax.actor.env_workers import EnvironmentPool, EnvWorkerError
from composer_jax.actor.ids import GroupId
from composer_jax.actor.lifecycle import Counters, GroupSlot, Sample, SampleState
from composer_jax.actor.rollout import segment_kind, token_kinds, turn_sampling
from composer_jax.actor.sampler import Sampler
from composer_jax.config import RLConfig
from composer_jax.data.chat import ChatFormat
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.envs import EnvConfig
from composer_jax.infer import Completion, SamplingParams
from composer_jax.rl.batch import SegmentKind

log = logging.getLogger(__name__)

SUMMARY_OPEN, SUMMARY_CLOSE = "<summary>", "</summary>"
SUMMARY_NOTE = (
    "\n[context budget reached: summarise the task and your progress for a fresh start]\n"
)
MAX_ATTEMPTS = 3  # environment failures a sample survives before it is scored 0


@dataclasses.dataclass
class RolloutState:
    """What the rollout thread and the trainer loop share (under `lock`)."""

    groups: dict[GroupId, GroupSlot] = dataclasses.field(default_factory=dict)  # in flight
    active: list[Sample] = dataclasses.field(default_factory=list)  # not yet scored
    waiting: collections.deque = dataclasses.field(default_factory=collections.deque)  # for a slot
    by_request: dict[int, Sample] = dataclasses.field(default_factory=dict)  # in the sampler
    counters: Counters = dataclasses.field(default_factory=Counters)
    lock: threading.Condition = dataclasses.field(default_factory=threading.Condition)

    def needing_slots(self) -> int:
        """Samples that hold a sampler slot or will: all not yet scored but those whose last
        turn is in the environment (their slot was released, see `EpisodeDriver.on_completion`)."""
        return sum(
            1
            for s in self.active
            if s.state is not SampleState.IN_ENV or s.request_id in self.by_request
        )


class EpisodeDriver:
    """Moves samples through SCHEDULED -> GENERATING <-> IN_ENV -> SCORED (rollout thread only);
    calls `on_scored(sample)` once a sample is scored."""

    def __init__(
        self,
        cfg: RLConfig,
        sampler: Sampler,
        env_pool: EnvironmentPool,
        tokenizer: Tokenizer,
        chat: ChatFormat,
        env_config: EnvConfig,
        state: RolloutState,
        num_moe_layers: int,
        experts_per_token: int,
        seed: int,
        on_scored: Callable[[Sample], None],
    ):
        self.cfg, self.sampler, self.env_pool = cfg, sampler, env_pool
        self.tokenizer, self.chat, self.env_config = tokenizer, chat, env_config
        self.state, self.on_scored, self.seed = state, on_scored, seed
        self.num_moe_layers, self.k = num_moe_layers, experts_per_token
        self.detectors = feedback.make_detectors(cfg.feedback_detectors)
        base = SamplingParams(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            keep_cache=True,
        )
        self._turn_params = turn_sampling(base, chat)
        self._summary_params = turn_sampling(
            dataclasses.replace(base, max_new_tokens=cfg.summary_max_tokens),
            chat,
            markers=(SUMMARY_CLOSE,),
        )

    # ------------------------------------------------------------------------ scheduling
    def start(self, sample: Sample, snapshot: dict | None = None) -> None:
        """Starts the sample's episode (resumed from an environment snapshot if given)."""
        sample.state = SampleState.SCHEDULED
        sample.pending = self.env_pool.start(
            sample.episode_id, sample.group.task, self.env_config, snapshot
        )
        self.state.active.append(sample)

    def params_for(self, sample: Sample, summary: bool = False) -> SamplingParams:
        base = self._summary_params if summary else self._turn_params
        # Distinct, reproducible randomness per sample, attempt and generation.
        key = f"{self.seed}/{sample.sample_id}/{sample.summaries}"
        return dataclasses.replace(base, seed=zlib.crc32(key.encode()) & 0x7FFFFFFF)

    def feed_sampler(self) -> None:
        """Submits waiting samples while the sampler has free slots."""
        state = self.state
        free = self.sampler.num_slots - len(state.by_request)
        while free > 0 and state.waiting:
            sample = state.waiting.popleft()
            params = self.params_for(sample)
            tokens = sample.prompt_tokens
            if sample.resume_from is not None:  # the whole buffer is the context
                tokens = sample.tokens
                room = self.sampler.max_len - len(tokens) - 1
                params = dataclasses.replace(
                    params, max_new_tokens=min(params.max_new_tokens, room)
                )
            sample.request_id = self.sampler.submit(tokens, params)
            state.by_request[sample.request_id] = sample
            sample.state = SampleState.GENERATING
            free -= 1

    def advance_env(self) -> bool:
        """Handles every environment future that completed; True if any did."""
        progressed = False
        for sample in list(self.state.active):
            future = sample.pending
            if future is None or not future.done():
                continue
            progressed = True
            sample.pending = None
            try:
                result = future.result()
            except Exception as e:  # noqa: BLE001 -- a worker crash or an environment's own error
                self.requeue(sample, e)
                continue
            if sample.state is SampleState.SCHEDULED:
                if sample.resume_from is None:
                    prompt = self.chat.prompt(result)
                    sample.prompt_tokens = prompt
                    sample.add_context(prompt, SegmentKind.PROMPT)
                self.state.waiting.append(sample)
            else:
                self.on_step(sample, result)
        return progressed

    def requeue(self, sample: Sample, error: Exception) -> None:
        """The sample's environment failed: free its slot and start it over, at most
        MAX_ATTEMPTS times (then it is scored 0 as truncated, so its group can finish)."""
        state = self.state
        with state.lock:
            state.counters.env_failures += 1
            if not isinstance(error, EnvWorkerError):
                state.counters.env_errors += 1
        if sample.attempt + 1 >= MAX_ATTEMPTS:
            log.warning("%s: %r; giving up (reward 0)", sample.episode_id, error)
            sample.truncated, sample.reward = True, 0.0
            sample.routes = sample.routes[: max(len(sample.tokens) - 1, 0)]
            if not sample.tokens:  # never started: an empty generation cannot be trained on
                sample.add_context(self.tokenizer.encode("\n"), SegmentKind.PROMPT)
            while len(sample.routes) < len(sample.tokens) - 1:
                sample.routes.append(np.zeros((self.num_moe_layers, self.k), np.int32))
            self.finish(sample)
            return
        with state.lock:
            state.counters.samples_requeued += 1
        self._release(sample)
        state.active.remove(sample)
        self.env_pool.close(sample.episode_id)
        log.warning("%s: %r; re-queued", sample.episode_id, error)
        sample.reset()
        self.start(sample)

    def restart_all(self) -> None:
        """The sampler was lost with every request: start each active sample over."""
        state = self.state
        state.by_request.clear()
        state.waiting.clear()
        for sample in list(state.active):
            state.active.remove(sample)
            self.env_pool.close(sample.episode_id)
            with state.lock:
                state.counters.samples_requeued += 1
            sample.reset()
            self.start(sample)

    # ------------------------------------------------------------------- turn by turn
    def on_completion(self, c: Completion) -> None:
        sample = self.state.by_request.get(c.request_id)
        if sample is None:
            return
        if sample.summarising:
            self._finish_summary(sample, c)
            return
        if sample.resume_from is not None:  # the recorded prefix keeps its recorded routes
            c.prompt_experts = c.prompt_experts[sample.resume_from :]
            sample.resume_from = None
        sample.add_turn(c, token_kinds(c.tokens, self.tokenizer))
        sample.turn_text = self.tokenizer.decode(c.tokens)
        sample.state = SampleState.IN_ENV
        sample.pending = self.env_pool.step(sample.episode_id, sample.turn_text)
        sample.finish_reason = c.finish_reason
        if sample.counts.get("turns", 0) + 1 >= self.env_config.max_turns:
            # The environment ends the episode at this step (its turn limit), so nothing will
            # continue the request: its cache slot takes the next sample while the turn runs and
            # is graded (about 100 ms on 2 cores, a third of a one-turn sample's time).
            self._release(sample)

    def on_step(self, sample: Sample, result) -> None:
        cfg = self.cfg
        self._check_feedback(sample, result)
        sample.counts, sample.reward = result.counts, result.reward
        if result.done:
            sample.flagged = bool(result.flags)
            if result.flags:
                with self.state.lock:
                    self.state.counters.flagged_samples += 1
                    self.state.counters.monitor_flags.update({f.kind for f in result.flags})
            self.finish(sample)
            return
        generated = sample.tokens[-1:]  # did the turn end with the template's end of turn?
        segments = self.chat.after_turn(result.observation, generated)
        appended = [i for segment in segments for i in segment.ids]
        full = sample.finish_reason == "max_len"
        room = self.sampler.max_len - len(sample.tokens) - len(appended) - 1
        if cfg.summary_budget and sample.summaries < cfg.max_summaries:
            if len(sample.tokens) + len(appended) >= cfg.summary_budget and not full:
                self._request_summary(sample, result.observation, generated)
                return
        if full or room < 16:
            sample.truncated = True  # no room for another turn: reward 0
            sample.reward = 0.0
            self.finish(sample)
            return
        for segment in segments:
            sample.add_context(segment.ids, segment_kind(segment))
        params = dataclasses.replace(
            self.params_for(sample), max_new_tokens=min(cfg.max_new_tokens, room)
        )
        self._continue(sample, appended, params)

    def _continue(self, sample: Sample, appended: list[int], params: SamplingParams) -> None:
        by_request = self.state.by_request
        del by_request[sample.request_id]
        sample.request_id = self.sampler.continue_request(sample.request_id, appended, params)
        by_request[sample.request_id] = sample
        sample.state = SampleState.GENERATING

    def _request_summary(self, sample: Sample, observation: str, generated: list[int]) -> None:
        """Appends the tool output and the summary request; the next turn is the summary."""
        segments = self.chat.after_turn(
            observation, generated, note=SUMMARY_NOTE, assistant_prefix=SUMMARY_OPEN
        )
        appended = [i for segment in segments for i in segment.ids]
        room = self.sampler.max_len - len(sample.tokens) - len(appended) - 1
        if room < 8:  # the budget leaves no room for a summary: the sample is truncated
            sample.truncated = True
            sample.reward = 0.0
            self.finish(sample)
            return
        for segment in segments:
            sample.add_context(segment.ids, segment_kind(segment))
        sample.summarising = True
        params = dataclasses.replace(
            self.params_for(sample, summary=True),
            max_new_tokens=min(self.cfg.summary_max_tokens, room),
        )
        self._continue(sample, appended, params)

    def _finish_summary(self, sample: Sample, c: Completion) -> None:
        """Closes the generation with its summary; the next one starts from task + summary,
        reusing the cached task prompt."""
        sample.add_turn(c, np.full(len(c.tokens), SegmentKind.SUMMARY, np.int32))
        summary = self.tokenizer.decode(c.tokens)
        if not summary.endswith(SUMMARY_CLOSE):
            summary += SUMMARY_CLOSE
        sample.close_generation(self.num_moe_layers, self.k)
        sample.summaries += 1
        with self.state.lock:
            self.state.counters.summaries += 1
        keep = len(sample.prompt_tokens)
        prefix_routes = sample.routes[:keep]
        appended = self.tokenizer.encode(f"{SUMMARY_OPEN}{summary}\n")
        sample.clear_generation()
        sample.add_context(sample.prompt_tokens, SegmentKind.PROMPT)
        sample.add_context(appended, SegmentKind.PROMPT)  # carried over: counted once, as context
        # The kept prefix is cached with its routes; the restart prefills (and routes) only the
        # appended tokens, from position `keep` on.
        sample.routes = prefix_routes
        sample.summarising = False
        room = self.sampler.max_len - keep - len(appended) - 1
        params = dataclasses.replace(
            self.params_for(sample), max_new_tokens=min(self.cfg.max_new_tokens, room)
        )
        by_request = self.state.by_request
        del by_request[sample.request_id]
        sample.request_id = self.sampler.restart_request(sample.request_id, keep, appended, params)
        by_request[sample.request_id] = sample
        sample.state = SampleState.GENERATING

    def _check_feedback(self, sample: Sample, result) -> None:
        if not self.detectors:
            return
        turn = feedback.TurnRecord(
            index=len(sample.turns),
            text=sample.turn_text,
            calls=tuple(result.info.get("calls", ())),
            observation=result.observation,
            available_tools=tuple(self.env_config.tools),
        )
        previous = sample.turns[-1] if sample.turns else None
        sample.turns.append(turn)
        hints = feedback.check_turn(self.detectors, turn, previous)
        if not hints:
            return
        if self.cfg.distill_coef > 0:  # the teacher context is only built when it is trained on
            hint = self.tokenizer.encode(feedback.render_hint(hints))
            start, end = sample.turn_span
            sample.hinted.append((start, end, np.asarray(hint, np.int32)))
        for name, _ in hints:
            sample.feedback_counts[name] = sample.feedback_counts.get(name, 0) + 1
            with self.state.lock:
                self.state.counters.feedback[name] += 1

    # ------------------------------------------------------------------------- scoring
    def _release(self, sample: Sample) -> None:
        if sample.request_id in self.state.by_request:
            del self.state.by_request[sample.request_id]
            self.sampler.release(sample.request_id)

    def finish(self, sample: Sample) -> None:
        state = self.state
        self._release(sample)
        self.env_pool.close(sample.episode_id)
        state.active.remove(sample)
        sample.close_generation(self.num_moe_layers, self.k)
        sample.state = SampleState.SCORED
        with state.lock:
            state.counters.samples_finished += 1
            state.counters.turns += int(sample.counts.get("turns", 0))
            state.counters.truncated += int(sample.truncated)
        self.on_scored(sample)
