"""The coordinator of asynchronous RL: moves samples through their lifecycle between the roles.

    scheduled -> generating <-> in environment -> scored -> grouped (ledger) -> trained

A rollout thread drives the sampler and the environment pool: it schedules whole groups of one
prompt (fixed group size, one epoch over the prompts), hands every finished turn to the sample's
environment, continues the request with the tool output, and, when every sample of a group is
scored, persists the group in the `GroupLedger`. The trainer loop (the caller's thread) takes
finished groups as they come, drops or re-weights those whose oldest token lags too far, trains,
and publishes the new weights, which the sampler picks up between two decode steps.

Staleness is bounded at both ends: a group is only scheduled while the trainer version it will
meet (current version plus the untrained groups ahead of it) is within `max_staleness` of the
sampler's version, and groups that still end up too stale are handled by `stale_policy`.

Long rollouts summarise themselves: when a generation reaches `summary_budget` tokens, the policy is
asked for a summary and continues from system prompt + task + summary, reusing the cached prompt;
the chain of generations is one sample. Text feedback: detectors flag turns, and the sample's
teacher context gets a hint before each flagged turn.

An environment worker that crashes or hangs fails its samples' futures; they are re-queued from
scratch and counted, and training goes on. At each checkpoint the groups in flight are saved
(`save_in_flight`, see `composer_jax.actor.inflight`), and a restart resumes them mid-episode.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import traceback
import zlib
from concurrent.futures import Future

import numpy as np

from composer_jax.actor import feedback, inflight
from composer_jax.actor.env_workers import EnvironmentPool, EnvWorkerError
from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.lifecycle import Counters, GroupSlot, Sample
from composer_jax.actor.ray_backend import SamplerLostError
from composer_jax.actor.rollout import segment_kind, token_kinds, turn_sampling
from composer_jax.actor.sampler import Sampler
from composer_jax.actor.samples import SampleResult, make_group
from composer_jax.config import RLConfig
from composer_jax.data.chat import chat_format_for
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.envs import EnvConfig, Task
from composer_jax.infer import Completion, SamplingParams
from composer_jax.rl.batch import SegmentKind

SUMMARY_OPEN, SUMMARY_CLOSE = "<summary>", "</summary>"
SUMMARY_NOTE = (
    "\n[context budget reached: summarise the task and your progress for a fresh start]\n"
)


MAX_ATTEMPTS = 3  # environment failures a sample survives before it is scored 0
SYNC_INTERVAL_S = 0.1


class RolloutFailedError(RuntimeError):
    """The rollout thread stopped on an error that is not an environment worker's failure."""


class Coordinator:
    """Runs rollouts in a background thread and hands finished groups to the trainer loop."""

    def __init__(
        self,
        cfg: RLConfig,
        sampler: Sampler,
        env_pool: EnvironmentPool,
        ledger: GroupLedger,
        prompts: list[tuple[str, Task]],
        tokenizer: Tokenizer,
        num_moe_layers: int,
        experts_per_token: int,
        env_config: EnvConfig = EnvConfig(),
        seed: int = 0,
        resume: list[inflight.GroupState] = (),
        inflight_store: inflight.InFlightStore | None = None,
    ):
        self.cfg = cfg
        self.sampler, self.env_pool, self.ledger = sampler, env_pool, ledger
        self.tokenizer = tokenizer
        self.chat = chat_format_for(tokenizer)  # how prompts and tool outputs become tokens
        self.num_moe_layers, self.k = num_moe_layers, experts_per_token
        self.env_config = dataclasses.replace(env_config, max_turns=cfg.max_turns)
        self.seed = seed
        self.detectors = feedback.make_detectors(cfg.feedback_detectors)
        self._queue: collections.deque[tuple[str, Task]] = collections.deque(
            (gid, task) for gid, task in prompts if gid not in ledger
        )
        self.inflight_store = inflight_store
        self._snapshot_requests: list[tuple[int, Future]] = []
        self._pending_snapshot = None
        queued = dict(self._queue)
        self._resume = [
            (g, queued[g.group_id])
            for g in resume
            if g.group_id in queued
            and all(s.index < cfg.group_size for s in g.samples)
            and len({s.index for s in g.samples}) == len(g.samples)
        ]
        resumed = {g.group_id for g, _ in self._resume}
        self._queue = collections.deque(p for p in self._queue if p[0] not in resumed)
        self._num_prompts = len(prompts)
        self._tasks = {gid.split("-")[0]: task for gid, task in prompts}
        self._redos = 0
        self.sampler_stats: dict[str, float] = {}  # refreshed by the rollout thread only
        self._last_sync = 0.0
        self._hard: list[tuple[float, str, Task]] = []  # (hardness, group id, task) seen so far
        self._revisits = 0
        self._groups: dict[str, GroupSlot] = {}
        self._waiting: collections.deque[Sample] = collections.deque()  # ready for a slot
        self._active: list[Sample] = []
        self._by_request: dict[int, Sample] = {}
        self.counters = Counters()
        self._lock = threading.Condition()
        # Groups scheduled (resumed ones included) or finished, not yet trained.
        self._untrained = len(ledger.pending()) + len(self._resume)
        self.trainer_version = 0
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        base = SamplingParams(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            keep_cache=True,
        )
        self._turn_params = turn_sampling(base, self.chat)
        self._summary_params = turn_sampling(
            dataclasses.replace(base, max_new_tokens=cfg.summary_max_tokens),
            self.chat,
            markers=(SUMMARY_CLOSE,),
        )
        self.first_token_time: float | None = None

    # ----------------------------------------------------------------- trainer-facing API

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the rollout thread; re-raises its failure, if it had one."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for sample in list(self._active):
            self.env_pool.close(sample.episode_id)
        self._fail_snapshot_requests("the coordinator stopped before saving")
        if self._error is not None:
            raise RolloutFailedError("the rollout thread failed") from self._error

    @property
    def exhausted(self) -> bool:
        """No prompt left to schedule and nothing in flight."""
        with self._lock:
            return not self._queue and not self._groups

    def wait_for_groups(
        self, count: int, timeout_s: float | None = None, interrupted=None
    ) -> list[str] | None:
        """Blocks until `count` groups are pending in the ledger (fewer once the epoch is over);
        re-raises a failure of the rollout thread. `interrupted()` is polled while waiting (it
        may raise); once it returns True the wait ends with None."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while True:
                if self._error is not None:
                    raise RolloutFailedError("the rollout thread failed") from self._error
                if interrupted is not None and interrupted():
                    return None
                pending = self.ledger.pending()
                if len(pending) >= count or (not self._queue and not self._groups):
                    return pending[:count]
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{count} groups not ready in {timeout_s} s")
                self._lock.wait(timeout=0.5 if remaining is None else min(remaining, 0.5))

    def redispatch(self, group_ids: list[str], version: int) -> None:
        """Schedules the prompts of dropped groups again (first in line), so the epoch still
        covers every prompt."""
        with self._lock:
            for gid in group_ids:
                base = gid.split("-")[0]
                redo = f"{base}-redo{version}n{self._redos}"
                while redo in self.ledger:  # an id a previous start already used
                    self._redos += 1
                    redo = f"{base}-redo{version}n{self._redos}"
                self._redos += 1
                self._queue.appendleft((redo, self._tasks[base]))
                self._num_prompts += 1
            self._lock.notify_all()

    def save_in_flight(self, step: int) -> Future:
        """Asks the rollout thread to save the groups in flight as of trainer step `step` (see
        `composer_jax.actor.inflight`); the future gives how many samples were saved mid-episode."""
        future: Future = Future()
        if self.inflight_store is None:
            future.set_result(0)
            return future
        with self._lock:
            if self._error is None:
                self._snapshot_requests.append((step, future))
                return future
        future.set_exception(RolloutFailedError("the rollout thread failed"))
        return future

    def _fail_snapshot_requests(self, message: str) -> None:
        with self._lock:
            requests, self._snapshot_requests = self._snapshot_requests, []
            if self._pending_snapshot is not None:
                requests.append(self._pending_snapshot[:2])
                self._pending_snapshot = None
        for _, future in requests:
            future.set_exception(RuntimeError(message))

    def groups_trained(self, count: int, new_version: int) -> None:
        """The trainer consumed (or dropped) `count` groups and now holds `new_version`."""
        with self._lock:
            self._untrained -= count
            self.trainer_version = new_version
            self._lock.notify_all()

    def snapshot(self) -> dict[str, float]:
        """Counters for the metrics line."""
        with self._lock:
            c = self.counters
            states = collections.Counter(s.state for s in self._active)
            out = {
                "groups_scheduled": c.groups_scheduled,
                "groups_finished": c.groups_finished,
                "samples_requeued": c.samples_requeued,
                "samples_resumed": c.samples_resumed,
                "samples_finished": c.samples_finished,
                "rollout_reward_sum": c.reward_sum,
                "rollout_reward_samples": c.reward_samples,
                "env_failures": c.env_failures,
                "env_errors": c.env_errors,
                "sampler_failures": c.sampler_failures,
                "summaries_total": c.summaries,
                "truncated_total": c.truncated,
                "weight_updates_in_flight": c.weight_updates_in_flight,
                "samples_generating": states["generating"] + len(self._waiting),
                "samples_in_env": states["in_env"],
                "sampler_version": self.sampler.version or 0,
                "revisited_prompts": self._revisits,
            }
            out.update({f"feedback/{name}": n for name, n in c.feedback.items()})
            out["flagged_samples"] = c.flagged_samples
            out.update({f"monitor/{kind}": n for kind, n in c.monitor_flags.items()})
        out.update({f"env/{k}": v for k, v in self.env_pool.health().items()})
        return out

    # ----------------------------------------------------------------- rollout thread

    def _run(self) -> None:
        try:
            self._resume_groups()
            while not self._stop.is_set():
                try:
                    self._serve_snapshots()
                    self._sync_weights()
                    self._schedule()
                    self._feed_sampler()
                    progressed = self._advance_env()
                    finished = self.sampler.poll() if self._by_request else []
                    for completion in finished:
                        self._on_completion(completion)
                except SamplerLostError as e:
                    self._sampler_lost(e)
                    continue
                if not finished and not progressed:
                    with self._lock:
                        idle = not self._groups and not self._queue
                    time.sleep(0.05 if idle else 0.002)
        except BaseException as e:  # noqa: BLE001 -- surfaced to the trainer loop
            traceback.print_exc()
            with self._lock:
                self._error = e
                self._lock.notify_all()
            self._fail_snapshot_requests("the rollout thread failed")

    def _resume_groups(self) -> None:
        """Rebuilds the groups saved in flight: scored samples as they were, samples between two
        turns from their environment snapshot, the others from scratch."""
        resume, self._resume = self._resume, []
        for saved_group, task in resume:
            group = GroupSlot(
                saved_group.group_id, task, scheduled_at_version=saved_group.scheduled_at_version
            )
            group.samples = [Sample(group=group, index=i) for i in range(self.cfg.group_size)]
            saved = {
                s.index: s
                for s in saved_group.samples
                if s.newest_version <= self.trainer_version  # else: weights never restored
            }
            with self._lock:
                self._groups[group.group_id] = group
                self.counters.groups_scheduled += 1
            for sample in group.samples:
                state = saved.get(sample.index)
                if state is None:
                    self._start_episode(sample)
                    continue
                inflight.apply(state, sample)
                if state.scored:
                    sample.state = "scored"
                    continue
                sample.resume_from = len(sample.routes)
                self._start_episode(sample, state.env_snapshot)
                with self._lock:
                    self.counters.samples_resumed += 1
            if all(s.state == "scored" for s in group.samples):
                self._finish_group(group)

    def _serve_snapshots(self) -> None:
        """Starts the oldest requested in-flight save, or completes the one under way once the
        environment snapshots it asked for have arrived."""
        if self._pending_snapshot is None:
            with self._lock:
                if not self._snapshot_requests:
                    return
                step, future = self._snapshot_requests.pop(0)
            self._pending_snapshot = (step, future, *self._capture_in_flight())
            return
        step, future, groups, waits = self._pending_snapshot
        if not all(env_future.done() for _, env_future in waits):
            return
        self._pending_snapshot = None
        resumable = 0
        for state, env_future in waits:
            try:
                state.env_snapshot = env_future.result()
                resumable += 1
            except Exception:  # noqa: BLE001 -- a lost episode: that sample will start over
                for group in groups:
                    if state in group.samples:
                        group.samples.remove(state)
        try:
            self.inflight_store.save(step, groups)
        except Exception as error:  # noqa: BLE001 -- reported to the caller
            future.set_exception(error)
            return
        future.set_result(resumable)

    def _capture_in_flight(self):
        """Copies of every group in flight: scored samples, and samples waiting on the policy
        after at least one environment step (with a request for their environment snapshot)."""
        groups, waits = [], []
        for group in self._groups.values():
            states = []
            for sample in group.samples:
                if sample.state == "scored" or sample.between_turns:
                    state = inflight.capture(sample, scored=sample.state == "scored")
                    states.append(state)
                    if sample.between_turns:
                        waits.append((state, self.env_pool.snapshot(sample.episode_id)))
            groups.append(inflight.GroupState(group.group_id, group.scheduled_at_version, states))
        return groups, waits

    def _sampler_lost(self, error: Exception) -> None:
        """Every request died with the sampler: start each active sample over."""
        print(f"[rollout] {error}; re-queuing {len(self._active)} samples", flush=True)
        self._by_request.clear()
        self._waiting.clear()
        with self._lock:
            self.counters.sampler_failures += 1
        for sample in list(self._active):
            self._active.remove(sample)
            self.env_pool.close(sample.episode_id)
            with self._lock:
                self.counters.samples_requeued += 1
            sample.reset()
            self._start_episode(sample)

    def _sync_weights(self) -> None:
        """Pulls new weights and refreshes the sampler's stats, at most every SYNC_INTERVAL_S
        (a listing of the store may be a remote call)."""
        now = time.monotonic()
        if now - self._last_sync < SYNC_INTERVAL_S:
            return
        self._last_sync = now
        before = self.sampler.version
        after = self.sampler.sync_weights()
        if after != before and self._by_request:
            self.counters.weight_updates_in_flight += 1
        self.sampler_stats = self.sampler.stats()

    def _next_prompt(self) -> tuple[str, Task] | None:
        """The next prompt; past half the epoch, a share of groups revisits the hardest ones."""
        cfg = self.cfg
        used = self._num_prompts - len(self._queue)
        if (
            cfg.hard_prompt_fraction > 0
            and used >= self._num_prompts // 2
            and self._hard
            and np.random.default_rng(self.seed + used + self._revisits).random()
            < cfg.hard_prompt_fraction
        ):
            self._hard.sort(key=lambda h: h[0])
            _, gid, task = self._hard.pop()
            self._revisits += 1
            return f"{gid}-again{self._revisits}", task
        return self._queue.popleft() if self._queue else None

    def _schedule(self) -> None:
        cfg = self.cfg
        with self._lock:
            while True:
                in_flight = sum(len(g.samples) for g in self._groups.values())
                if in_flight + cfg.group_size > cfg.num_slots:
                    return
                # The version this group will meet when trained, against the one sampling it.
                meets = self.trainer_version + self._untrained // cfg.groups_per_step
                if meets - (self.sampler.version or 0) > cfg.max_staleness:
                    return
                nxt = self._next_prompt()
                if nxt is None:
                    return
                gid, task = nxt
                group = GroupSlot(gid, task, scheduled_at_version=self.sampler.version or 0)
                group.samples = [Sample(group=group, index=i) for i in range(cfg.group_size)]
                self._groups[gid] = group
                self._untrained += 1
                self.counters.groups_scheduled += 1
                for sample in group.samples:
                    self._start_episode(sample)

    def _start_episode(self, sample: Sample, snapshot: dict | None = None) -> None:
        sample.episode_id = f"{sample.group.group_id}-s{sample.index}-a{sample.attempt}"
        sample.state = "scheduled"
        sample.pending = self.env_pool.start(
            sample.episode_id, sample.group.task, self.env_config, snapshot
        )
        self._active.append(sample)

    def _params_for(self, sample: Sample, summary: bool = False) -> SamplingParams:
        base = self._summary_params if summary else self._turn_params
        # Distinct, reproducible randomness per sample and attempt.
        key = f"{self.seed}/{sample.group.group_id}/{sample.index}/{sample.attempt}/{sample.summaries}"
        seed = zlib.crc32(key.encode()) & 0x7FFFFFFF
        return dataclasses.replace(base, seed=seed)

    def _feed_sampler(self) -> None:
        free = self.sampler.num_slots - len(self._by_request)
        while free > 0 and self._waiting:
            sample = self._waiting.popleft()
            params = self._params_for(sample)
            tokens = sample.prompt_tokens
            if sample.resume_from is not None:  # the whole buffer is the context
                tokens = sample.tokens
                room = self.sampler.max_len - len(tokens) - 1
                params = dataclasses.replace(
                    params, max_new_tokens=min(params.max_new_tokens, room)
                )
            sample.request_id = self.sampler.submit(tokens, params)
            self._by_request[sample.request_id] = sample
            sample.state = "generating"
            free -= 1

    def _advance_env(self) -> bool:
        """Handles every environment future that completed; True if any did."""
        progressed = False
        for sample in list(self._active):
            future = sample.pending
            if future is None or not future.done():
                continue
            progressed = True
            sample.pending = None
            try:
                result = future.result()
            except Exception as e:  # noqa: BLE001 -- a worker crash or an environment's own error
                self._requeue(sample, e)
                continue
            if sample.state == "scheduled":
                if sample.resume_from is None:
                    prompt = self.chat.prompt(result)
                    sample.prompt_tokens = prompt
                    sample.add_context(prompt, SegmentKind.PROMPT)
                self._waiting.append(sample)
            else:
                self._on_step(sample, result)
        return progressed

    def _requeue(self, sample: Sample, error: Exception) -> None:
        """The sample's environment failed: free its slot and start it over, at most
        MAX_ATTEMPTS times (then it is scored 0 as truncated, so its group can finish)."""
        with self._lock:
            self.counters.env_failures += 1
            if not isinstance(error, EnvWorkerError):
                self.counters.env_errors += 1
        if sample.attempt + 1 >= MAX_ATTEMPTS:
            print(f"[rollout] {sample.episode_id}: {error!r}; giving up (reward 0)", flush=True)
            sample.truncated, sample.reward = True, 0.0
            sample.routes = sample.routes[: max(len(sample.tokens) - 1, 0)]
            if not sample.tokens:  # never started: an empty generation cannot be trained on
                sample.add_context(self.tokenizer.encode("\n"), SegmentKind.PROMPT)
            while len(sample.routes) < len(sample.tokens) - 1:
                sample.routes.append(np.zeros((self.num_moe_layers, self.k), np.int32))
            self._finish(sample)
            return
        with self._lock:
            self.counters.samples_requeued += 1
        if sample.request_id in self._by_request:
            del self._by_request[sample.request_id]
            self.sampler.release(sample.request_id)
        self._active.remove(sample)
        self.env_pool.close(sample.episode_id)
        print(f"[rollout] {sample.episode_id}: {error!r}; re-queued", flush=True)
        sample.reset()
        self._start_episode(sample)

    def _on_completion(self, c: Completion) -> None:
        sample = self._by_request.get(c.request_id)
        if sample is None:
            return
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if sample.summarising:
            self._finish_summary(sample, c)
            return
        if sample.resume_from is not None:  # the recorded prefix keeps its recorded routes
            c.prompt_experts = c.prompt_experts[sample.resume_from :]
            sample.resume_from = None
        sample.add_turn(c, token_kinds(c.tokens, self.tokenizer))
        sample.turn_text = self.tokenizer.decode(c.tokens)
        sample.state = "in_env"
        sample.pending = self.env_pool.step(sample.episode_id, sample.turn_text)
        sample.finish_reason = c.finish_reason

    def _on_step(self, sample: Sample, result) -> None:
        cfg = self.cfg
        self._check_feedback(sample, result)
        sample.counts, sample.reward = result.counts, result.reward
        if result.done:
            if result.flags:
                with self._lock:
                    self.counters.flagged_samples += 1
                    self.counters.monitor_flags.update({flag.kind for flag in result.flags})
            self._finish(sample)
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
            self._finish(sample)
            return
        for segment in segments:
            sample.add_context(segment.ids, segment_kind(segment))
        params = dataclasses.replace(
            self._params_for(sample), max_new_tokens=min(cfg.max_new_tokens, room)
        )
        self._continue(sample, appended, params)

    def _continue(self, sample: Sample, appended: list[int], params: SamplingParams) -> None:
        del self._by_request[sample.request_id]
        sample.request_id = self.sampler.continue_request(sample.request_id, appended, params)
        self._by_request[sample.request_id] = sample
        sample.state = "generating"

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
            self._finish(sample)
            return
        for segment in segments:
            sample.add_context(segment.ids, segment_kind(segment))
        sample.summarising = True
        params = dataclasses.replace(
            self._params_for(sample, summary=True),
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
        with self._lock:
            self.counters.summaries += 1
        keep = len(sample.prompt_tokens)
        prefix_routes = sample.routes[:keep]
        appended = self.tokenizer.encode(f"{SUMMARY_OPEN}{summary}\n")
        for name in ("tokens", "kinds", "policy", "logprobs", "versions", "routes", "flagged"):
            setattr(sample, name, [])
        sample.add_context(sample.prompt_tokens, SegmentKind.PROMPT)
        sample.add_context(appended, SegmentKind.PROMPT)  # carried over: counted once, as context
        # The kept prefix is cached with its routes; the restart prefills (and routes) only the
        # appended tokens, from position `keep` on.
        sample.routes = prefix_routes
        sample.summarising = False
        room = self.sampler.max_len - keep - len(appended) - 1
        params = dataclasses.replace(
            self._params_for(sample), max_new_tokens=min(self.cfg.max_new_tokens, room)
        )
        del self._by_request[sample.request_id]
        sample.request_id = self.sampler.restart_request(sample.request_id, keep, appended, params)
        self._by_request[sample.request_id] = sample
        sample.state = "generating"

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
            sample.flagged.append((start, end, np.asarray(hint, np.int32)))
        for name, _ in hints:
            sample.feedback_counts[name] = sample.feedback_counts.get(name, 0) + 1
            with self._lock:
                self.counters.feedback[name] += 1

    def _finish(self, sample: Sample) -> None:
        if sample.request_id in self._by_request:
            del self._by_request[sample.request_id]
            self.sampler.release(sample.request_id)
        self.env_pool.close(sample.episode_id)
        self._active.remove(sample)
        sample.close_generation(self.num_moe_layers, self.k)
        sample.state = "scored"
        with self._lock:
            self.counters.samples_finished += 1
            self.counters.turns += int(sample.counts.get("turns", 0))
            self.counters.truncated += int(sample.truncated)
        group = sample.group
        if all(s.state == "scored" for s in group.samples):
            self._finish_group(group)

    def _finish_group(self, group: GroupSlot) -> None:
        results = [
            SampleResult(
                sequences=s.sequences,
                reward=float(s.reward),
                num_tool_calls=int(s.counts.get("tool_calls", 0)),
                num_turns=int(s.counts.get("turns", 0)),
                summaries=s.summaries,
                truncated=s.truncated,
                feedback=dict(s.feedback_counts),
            )
            for s in group.samples
        ]
        self.ledger.add(make_group(group.group_id, group.task.task_id, results))
        hardness = max(r.num_turns for r in results) * 1e6 + max(r.thinking_tokens for r in results)
        with self._lock:
            del self._groups[group.group_id]
            self.counters.groups_finished += 1
            self.counters.reward_sum += float(sum(r.reward for r in results))
            self.counters.reward_samples += len(results)
            if self.cfg.hard_prompt_fraction > 0 and "-again" not in group.group_id:
                self._hard.append((hardness, group.group_id, group.task))
            self._lock.notify_all()
