"""A discrete-event model of the asynchronous actor loop, for what-if questions in seconds.

The real loop takes seconds to minutes per step, and its throughput comes from the interplay of
slot refills, the staleness bound, weight updates and long generations, which is hard to reason
about and too slow to sweep. This model replays that interplay on one event queue (no threads, no
JAX) from measured costs (`experiments/loop_calibration.py`). Where the loop has a
policy, the model runs the loop's own code: a group is admitted by `scheduler.admits_group`, and
the trainer takes its groups through `scheduler.next_groups` itself (stale groups dropped or
re-weighted per `stale_policy`), on an in-memory ledger. The timing is a model:
- Samplers batch continuously like `InferenceEngine`: at each decode-step boundary, continuing
  turns and then queued samples (FIFO, into free slots) are prefilled, then every running row
  gets one token per decode step, which costs decode_s(rows), or decode_s(num_slots) with
  `padded_decode` (the shipped engine always decodes all its slots). A sample keeps its slot
  between turns (tool time, a pure delay, then its tool output is prefilled) and frees it
  after its last turn; then it is graded (grading_s). With a pool of `env_workers` (the real
  loop's `WorkerPool`) each episode is pinned to the worker with the fewest, whose calls run
  one at a time in order: its start (before the sample can queue for a slot), its grading and
  its close; without one (0), grading is a pure delay.
- The coordinator schedules a group whenever its samples fit the slots plus
  `schedule_ahead_groups` and the group is admitted; each sample goes to the least loaded sampler.
- The trainer trains a step of `groups_per_step` groups in train_s_per_token * tokens / ranks +
  train_overhead_s; the new version reaches the samplers publish_s later, and each sampler stops
  for rebuild_s to load it: between two decode steps with in-flight updates (generations go on
  under the new weights), or once its running generations have finished without them (it admits
  nothing meanwhile). max_staleness 0 is the synchronous loop.
- On a shared machine (2 cores) each role slows while the others work (`Costs.decode_train_s`,
  `decode_env_s`, `train_slowdown`, `env_slowdown`); compilation is a one-off cost of the first train step and decode.
A sample's staleness is its oldest token's (the version when it started); the mean token lag
counts every generated token at the version that produced it.
Not modelled: the prompt epoch's end (a dropped group's prompt is one more group), and the
prefill's own first token (every generated token costs a decode step).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
import math

import numpy as np

from composer_jax.actor import scheduler
from composer_jax.actor.sim_workload import Costs, Lengths, Workload
from composer_jax.config import RLConfig

__all__ = ["Costs", "Lengths", "SimConfig", "SimResult", "Simulation", "Workload", "simulate"]


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """`rl` gives the loop's settings (group_size, groups_per_step, max_staleness, stale_policy,
    stale_decay, num_slots, num_samplers, schedule_ahead_groups, max_new_tokens); the run lasts
    `steps` trainer steps. Gradings wait for one of `env_workers` (0: never wait). A step
    trains at least `min_train_tokens` tokens (the shipped trainer
    pads its batch to groups_per_step x group_size rows of context_len; 0: the tokens alone)."""

    rl: RLConfig
    workload: Workload = Workload()
    costs: Costs = Costs()
    steps: int = 100
    trainer_ranks: int = 1
    min_train_tokens: int = 0
    env_workers: int = 0  # a pool that grades one sample at a time each (0: unlimited)
    inflight_updates: bool = True
    padded_decode: bool = True
    seed: int = 0


@dataclasses.dataclass
class SimResult:
    seconds: float  # simulated time until the last step ended
    steps: int
    trained_samples: int
    samples_per_s: float
    trainer_busy: float  # fraction of the time
    sampler_busy: float  # fraction of the time, over all samplers
    slot_use: float  # mean share of the slots decoding, over all samplers and the whole time
    staleness: dict[int, int]  # oldest-token lag of the trained groups -> groups
    token_lag: float  # mean over trained generated tokens of (trainer version - token's version)
    dropped_groups: int
    reweighted_groups: int
    uninformative_groups: int  # dropped by dynamic sampling
    generated_samples: int  # scheduled, trained or not
    step_ends: list[float]  # simulated time at which each trainer step ended
    step_train_s: list[float]  # seconds each step trained

    def samples_per_s_after(self, step: int) -> float:
        """Trained samples per second over the steps after `step` (as the real loop's
        throughput is read after step 1, whose compilation it leaves out)."""
        per_step = self.trained_samples / self.steps
        return per_step * (self.steps - step) / self._seconds_after(step)

    def trainer_busy_after(self, step: int) -> float:
        """The trainer's busy share over the steps after `step` (past the pipeline's fill)."""
        return sum(self.step_train_s[step:]) / self._seconds_after(step)

    def _seconds_after(self, step: int) -> float:
        if not 0 < step < self.steps:
            raise ValueError(f"step {step} must be in 1..{self.steps - 1}")
        return self.step_ends[-1] - self.step_ends[step - 1]


class _Sample:
    __slots__ = ("group", "turns", "turn", "min_version", "start_step", "version_sum", "worker")

    def __init__(self, group: _Group, turns: list[int]):
        self.group, self.turns, self.turn = group, turns, 0
        self.worker: _EnvWorker | None = None  # its environment's, with a pool
        self.min_version = -1  # set when its first turn starts
        self.start_step = 0  # the sampler's decode step count when the current turn started
        self.version_sum = 0  # sum over its generated tokens of the version that made them


class _Group:
    """What `next_groups` reads of a ledger group (group_id, min_version, rewards, metadata:
    none abandoned), plus the tallies."""

    __slots__ = (
        "group_id",
        "metadata",
        "unscored",
        "min_version",
        "tokens",
        "generated",
        "version_sum",
        "prefix",
        "rewards",
    )

    def __init__(self, group_id: str, size: int, uniform: bool):
        self.group_id, self.unscored, self.metadata = group_id, size, {}
        self.rewards = np.zeros(size) if uniform else np.arange(size, dtype=float)
        self.prefix: tuple[_Sampler, int] | None = None  # where its prompt was last prefilled
        self.min_version = 1 << 62
        self.tokens = self.generated = self.version_sum = 0


class _Ledger:
    """The calls `next_groups` makes on a `GroupLedger`, in memory: finished groups not yet
    trained or dropped, in the order they finished."""

    def __init__(self):
        self.groups: dict[str, _Group] = {}
        self.dropped_uninformative = 0

    def pending(self) -> list[str]:
        return list(self.groups)

    def drop_stale(self, current_version: int, max_staleness: int) -> list[str]:
        """`GroupLedger.drop_stale`'s rule: the oldest token lags more than max_staleness."""
        stale = [
            gid for gid, g in self.groups.items() if current_version - g.min_version > max_staleness
        ]
        for gid in stale:
            del self.groups[gid]
        return stale

    def load(self, group_id: str) -> _Group:
        return self.groups[group_id]

    def drop(self, group_ids: list[str], version: int, reason: str) -> None:
        """`GroupLedger.drop`: next_groups drops the groups dynamic sampling skips."""
        for gid in group_ids:
            del self.groups[gid]
        self.dropped_uninformative += len(group_ids)


class _EnvWorker:
    """An environment worker of the pool: its episodes (pinned at start, to the worker with the
    fewest) and its calls, run one at a time in order."""

    __slots__ = ("episodes", "busy", "calls")

    def __init__(self):
        self.episodes, self.busy = 0, False
        self.calls: collections.deque = collections.deque()  # (seconds, done, sample)


IDLE, WAKING, DECODING, LOADING = "idle", "waking", "decoding", "loading"


class _Sampler:
    """One continuous-batching sampler: its slots, its queues and the decode run in progress
    (from `run_start`, `run_steps` steps of `step_s` each, until the next turn ends)."""

    def __init__(self, sim: Simulation):
        self.sim = sim
        self.waiting: collections.deque[_Sample] = collections.deque()  # for a free slot
        self.continuing: collections.deque[_Sample] = collections.deque()  # next turns: slot held
        self.running: list[tuple[int, int, _Sample]] = []  # heap of (step it ends at, tie, sample)
        self.held = 0  # slots held: running rows and samples between turns
        self.steps = 0  # decode steps done
        self.version = self.available = 0
        self.load_steps, self.load_versions = [0], [0]  # the version in use from each step count
        self.state, self.at_boundary = IDLE, False
        self.started = False
        self.busy = self.seg_start = self.run_start = self.step_s = 0.0
        self.row_seconds = 0.0  # integral of the running rows over the decoding time
        self.run_steps = 0
        self.token = 0  # a wake event carrying an older token was superseded

    @property
    def load(self) -> int:
        return self.held + len(self.waiting)

    def continue_turn(self, sample: _Sample) -> None:
        self.continuing.append(sample)
        self.poke()

    def publish(self, version: int) -> None:
        self.available = max(self.available, version)
        self.poke()

    def poke(self) -> None:
        """Something arrived: when idle, wake up once the events of this instant are done (what
        arrives together is admitted together); when decoding, end the run at the next step
        boundary if the arrival can act there (the engine admits and loads between steps)."""
        if self.at_boundary or self.state in (LOADING, WAKING):
            return
        sim = self.sim
        if self.state == IDLE:
            self.state, self.seg_start, self.run_steps = WAKING, sim.now, 0
            self.token += 1
            sim.at(sim.now, self.wake, self.token)
            return
        if not self._can_act() and self.step_s == self._step_cost():
            return
        steps = max(1, math.ceil((sim.now - self.run_start) / self.step_s - 1e-9))
        if steps < self.run_steps:
            self.run_steps = steps
            self.token += 1
            sim.at(max(sim.now, self.run_start + steps * self.step_s), self.wake, self.token)

    def _can_act(self) -> bool:
        if self.available > self.version:  # without in-flight updates it drains first
            return self.sim.cfg.inflight_updates
        free = self.held < self.sim.rl.rollout.num_slots
        return bool(self.continuing) or (bool(self.waiting) and free)

    def wake(self, token: int) -> None:
        """The decode run ended (a turn ended, or an arrival cut it short)."""
        if token != self.token:
            return
        self.busy += self.sim.now - self.seg_start
        self.row_seconds += len(self.running) * self.run_steps * self.step_s
        self.steps += self.run_steps
        self.run_steps = 0
        while self.running and self.running[0][0] <= self.steps:
            self._end_turn(heapq.heappop(self.running)[2])
        self._boundary()

    def _boundary(self) -> None:
        self.at_boundary = True
        self.sim.schedule()  # slots freed now take new groups at this very boundary
        self.at_boundary = False
        self._plan()

    def _end_turn(self, sample: _Sample) -> None:
        end = sample.start_step + sample.turns[sample.turn]
        sample.version_sum += self._version_sum(sample.start_step, end)
        sample.turn += 1
        sim = self.sim
        if sample.turn < len(sample.turns):  # parked in its slot during the tool call
            sim.at(sim.now + sim.cfg.workload.tool_s, self.continue_turn, sample)
        else:
            self.held -= 1
            sim.sample_generated(sample)

    def _version_sum(self, start: int, end: int) -> int:
        """Sum of the versions that made the tokens of decode steps start+1 .. end."""
        i = bisect.bisect_right(self.load_steps, start) - 1
        total = 0
        while start < end:
            stop = end if i + 1 == len(self.load_steps) else min(end, self.load_steps[i + 1])
            total += (stop - start) * self.load_versions[i]
            start, i = stop, i + 1
        return total

    def _plan(self) -> None:
        """At a step boundary: load new weights when allowed, else admit and prefill, and decode
        until the next turn ends; idle when nothing runs."""
        sim, costs = self.sim, self.sim.cfg.costs
        new_version = self.available > self.version
        self.seg_start = sim.now
        if new_version and (sim.cfg.inflight_updates or not self.running):
            self.state = LOADING
            sim.at(sim.now + costs.rebuild_s, self._loaded, self.available)
            return
        prefill = 0 if new_version else self._admit()
        if not self.running:
            self.state = IDLE
            return
        self.state, self.step_s = DECODING, self._step_cost()
        self.run_steps = self.running[0][0] - self.steps
        slowdown = self.step_s / sim.decode_s[self._rows()]
        self.run_start = sim.now + prefill * costs.prefill_s_per_token * slowdown
        if not self.started:  # compiles its prefill and decode
            self.started, self.run_start = True, self.run_start + costs.sampler_first_s
        self.token += 1
        sim.at(self.run_start + self.run_steps * self.step_s, self.wake, self.token)

    def _rows(self) -> int:
        sim = self.sim
        return sim.rl.rollout.num_slots if sim.cfg.padded_decode else len(self.running)

    def _step_cost(self) -> float:
        """Seconds of one decode step of the running rows, now (with what else works)."""
        sim, costs = self.sim, self.sim.cfg.costs
        seconds = sim.decode_s[self._rows()] + costs.decode_env_s * sim.env_working
        return seconds + (costs.decode_train_s if sim.training else 0.0)

    def _loaded(self, version: int) -> None:
        self.busy += self.sim.now - self.seg_start
        self.version = version
        if self.load_steps[-1] == self.steps:
            self.load_versions[-1] = version
        else:
            self.load_steps.append(self.steps)
            self.load_versions.append(version)
        self._boundary()

    def _admit(self) -> int:
        """Starts the continuing turns, then waiting samples in free slots (FIFO); returns the
        tokens to prefill."""
        work = self.sim.cfg.workload
        tokens = len(self.continuing) * work.tool_output_tokens
        while self.continuing:
            self._start(self.continuing.popleft())
        while self.waiting and self.held < self.sim.rl.rollout.num_slots:
            sample = self.waiting.popleft()
            self.held += 1
            sample.min_version = self.version
            if not work.share_prefixes or sample.group.prefix != (self, self.version):
                tokens += work.prompt_tokens
                sample.group.prefix = (self, self.version)
            self._start(sample)
        return tokens

    def _start(self, sample: _Sample) -> None:
        sample.start_step = self.steps
        end = self.steps + sample.turns[sample.turn]
        heapq.heappush(self.running, (end, next(self.sim.tie), sample))

    def busy_until(self, now: float) -> tuple[float, float]:
        """(busy seconds, row-seconds decoded) so far, the run in progress included."""
        if self.state == IDLE:
            return self.busy, self.row_seconds
        decoding = max(now - self.run_start, 0.0) if self.state == DECODING else 0.0
        return self.busy + now - self.seg_start, self.row_seconds + len(self.running) * decoding


class Simulation:
    """The coordinator and the trainer on one clock, with the samplers; `run` plays the loop
    until cfg.steps trainer steps. It is also the coordinator `next_groups` talks to."""

    def __init__(self, cfg: SimConfig):
        # Simulated groups have task rewards only: all equal or not (Workload.uniform_fraction).
        rl = dataclasses.replace(
            cfg.rl, rollout=dataclasses.replace(cfg.rl.rollout, uniform_by="task")
        )
        # The coordinator's bound on samples holding or awaiting a slot.
        self.capacity = (
            rl.rollout.num_slots * rl.rollout.num_samplers
            + rl.rollout.group_size * rl.rollout.schedule_ahead_groups
        )
        if self.capacity < rl.rollout.group_size:
            raise ValueError("a group's samples never fit the samplers' slots plus the lookahead")
        self.cfg, self.rl = cfg, rl
        self.decode_s = [cfg.costs.decode_step_s(rows) for rows in range(rl.rollout.num_slots + 1)]
        self.now = 0.0
        self._events: list = []
        self.tie = itertools.count()
        self._rng = np.random.default_rng(cfg.seed)
        self._uniform_rng = np.random.default_rng([cfg.seed, 1])
        self._lengths: list[int] = []
        self.samplers = [_Sampler(self) for _ in range(rl.rollout.num_samplers)]
        self.ledger = _Ledger()
        self.trainer_version = self.untrained = self.needing_slots = 0
        self.training = False
        self.train_busy = 0.0
        self.trained_samples = self.generated = self.dropped = self.reweighted = 0
        self.step_ends: list[float] = []
        self.step_train_s: list[float] = []
        self.env_workers = [_EnvWorker() for _ in range(cfg.env_workers)]
        self.env_working = 0  # of them
        self.staleness: collections.Counter[int] = collections.Counter()
        self.lag_sum = self.lag_tokens = 0

    def at(self, time: float, handler, arg) -> None:
        heapq.heappush(self._events, (time, next(self.tie), handler, arg))

    def run(self) -> SimResult:
        self.schedule()
        while self.trainer_version < self.cfg.steps:
            if not self._events:
                raise RuntimeError("the simulated loop stalled: nothing is left to happen")
            self.now, _, handler, arg = heapq.heappop(self._events)
            handler(arg)
        return self._result()

    # ------------------------------------------------------------- coordinator

    def schedule(self) -> None:
        """`Coordinator._schedule`: new groups while their samples fit the slots plus the
        lookahead and `admits_group` admits them at the oldest version a sampler holds."""
        rl, fed = self.rl, set()
        while self.needing_slots + rl.rollout.group_size <= self.capacity:
            version = min(s.version for s in self.samplers)
            if not scheduler.admits_group(rl, self.trainer_version, self.untrained, version):
                break
            fed.update(self._start_group())
        for sampler in fed:  # once all are queued, as the engine admits them in its next step
            sampler.poke()

    def _start_group(self) -> list[_Sampler]:
        """Queues a new group's samples, each on the least loaded sampler (with a pool of
        environment workers: once its environment started); returns the samplers fed now."""
        rl, turns = self.rl, self.cfg.workload.turns
        uniform = self._uniform_rng.random() < self.cfg.workload.uniform_fraction
        group = _Group(
            f"g{self.generated // rl.rollout.group_size}", rl.rollout.group_size, uniform
        )
        self.untrained += 1
        self.needing_slots += rl.rollout.group_size
        self.generated += rl.rollout.group_size
        fed = []
        for _ in range(rl.rollout.group_size):
            if len(self._lengths) < turns:
                self._lengths += self.cfg.workload.lengths.draw(
                    self._rng, 4096, rl.rollout.max_new_tokens
                )
            sample = _Sample(group, self._lengths[-turns:])
            del self._lengths[-turns:]
            if self.env_workers:
                sample.worker = min(self.env_workers, key=lambda w: w.episodes)
                sample.worker.episodes += 1
                self._env_call(sample, self.cfg.costs.env_start_s, self._env_started)
                continue
            sampler = min(self.samplers, key=lambda s: s.load)
            sampler.waiting.append(sample)
            fed.append(sampler)
        return fed

    def _env_started(self, sample: _Sample) -> None:
        sampler = min(self.samplers, key=lambda s: s.load)
        sampler.waiting.append(sample)
        sampler.poke()

    def sample_generated(self, sample: _Sample) -> None:
        """Its last turn left the sampler: its slot is free and it is graded (on its worker,
        with a pool), then its environment closed."""
        self.needing_slots -= 1
        if sample.worker is None:
            self.at(self.now + self._env_seconds(self.cfg.costs.grading_s), self._graded, sample)
        else:
            self._env_call(sample, self.cfg.costs.grading_s, self._graded)

    def _env_seconds(self, seconds: float) -> float:
        """An environment call's seconds, slowed on a shared machine while the roles work."""
        if self.training or any(s.state == DECODING for s in self.samplers):
            return seconds * self.cfg.costs.env_slowdown
        return seconds

    def _env_call(self, sample: _Sample, seconds: float, done) -> None:
        """Queues a call on the sample's worker; `done(sample)` when it has run."""
        worker = sample.worker
        worker.calls.append((seconds, done, sample))
        if not worker.busy:
            self._env_next(worker)

    def _env_next(self, worker: _EnvWorker) -> None:
        was_busy, worker.busy = worker.busy, bool(worker.calls)
        if worker.busy != was_busy:
            self.env_working += 1 if worker.busy else -1
            self._pace_changed()
        if worker.busy:
            seconds, done, sample = worker.calls.popleft()
            self.at(self.now + self._env_seconds(seconds), self._env_done, (worker, done, sample))

    def _env_done(self, call: tuple) -> None:
        worker, done, sample = call
        done(sample)
        self._env_next(worker)

    def _env_closed(self, sample: _Sample) -> None:
        sample.worker.episodes -= 1

    def _graded(self, sample: _Sample) -> None:
        if sample.worker is not None:
            self._env_call(sample, self.cfg.costs.env_close_s, self._env_closed)
        group, work = sample.group, self.cfg.workload
        generated = sum(sample.turns)
        extra = work.prompt_tokens + work.tool_output_tokens * (len(sample.turns) - 1)
        group.tokens += generated + extra
        group.generated += generated
        group.version_sum += sample.version_sum
        group.min_version = min(group.min_version, sample.min_version)
        group.unscored -= 1
        if not group.unscored:
            self.ledger.groups[group.group_id] = group
            self._train()

    def wait_for_groups(self, count: int, interrupted=None) -> list[str] | None:
        """`Coordinator.wait_for_groups` without the wait: None (as if interrupted) until `count`
        groups are pending; the trainer asks again when the next group finishes."""
        pending = self.ledger.pending()
        return pending[:count] if len(pending) >= count else None

    def groups_trained(self, count: int, new_version: int) -> None:
        self.untrained -= count
        self.trainer_version = new_version
        self.schedule()

    def redispatch(self, group_ids: list[str]) -> None:
        """Prompts never run out here: a dropped group's prompt is just one more group."""

    # ------------------------------------------------------------- trainer

    def _train(self) -> None:
        """An iteration of the trainer loop: `next_groups`, then a step on them (unless the
        trainer is busy, the run is over or too few groups are ready)."""
        if self.training or self.trainer_version >= self.cfg.steps:
            return
        version = self.trainer_version
        groups, weights, dropped = scheduler.next_groups(self, self.ledger, self.rl, version)
        self.dropped += dropped
        if groups is None:
            return
        for group, weight in zip(groups, weights):
            del self.ledger.groups[group.group_id]
            self.staleness[version - group.min_version] += 1
            self.reweighted += weight < 1
            self.lag_sum += version * group.generated - group.version_sum
            self.lag_tokens += group.generated
        costs = self.cfg.costs
        tokens = max(sum(g.tokens for g in groups), self.cfg.min_train_tokens)
        seconds = costs.train_s_per_token * tokens / self.cfg.trainer_ranks
        seconds += costs.train_overhead_s + (costs.train_first_s if version == 0 else 0.0)
        if any(s.state == DECODING for s in self.samplers):
            seconds *= costs.train_slowdown
        self.train_busy += seconds
        self.step_train_s.append(seconds)
        self.training = True
        self._pace_changed()
        self.at(self.now + seconds, self._trained, len(groups))

    def _pace_changed(self) -> None:
        """The trainer or an environment worker started or stopped: with a shared machine the
        decoding samplers change pace at their next step."""
        if self.cfg.costs.decode_train_s or self.cfg.costs.decode_env_s:
            for sampler in self.samplers:
                if sampler.state == DECODING:
                    sampler.poke()

    def _trained(self, count: int) -> None:
        self.training = False
        self._pace_changed()
        self.step_ends.append(self.now)
        self.trained_samples += count * self.rl.rollout.group_size
        self.groups_trained(count, self.trainer_version + 1)
        self.at(self.now + self.cfg.costs.publish_s, self._published, self.trainer_version)
        self._train()

    def _published(self, version: int) -> None:
        for sampler in self.samplers:
            sampler.publish(version)

    def _result(self) -> SimResult:
        seconds = self.now
        busy, rows = np.sum([s.busy_until(seconds) for s in self.samplers], axis=0)
        return SimResult(
            seconds=seconds,
            steps=self.trainer_version,
            trained_samples=self.trained_samples,
            samples_per_s=self.trained_samples / seconds,
            trainer_busy=self.train_busy / seconds,
            sampler_busy=float(busy) / (seconds * len(self.samplers)),
            slot_use=float(rows) / (seconds * len(self.samplers) * self.rl.rollout.num_slots),
            staleness=dict(sorted(self.staleness.items())),
            token_lag=self.lag_sum / max(self.lag_tokens, 1),
            dropped_groups=self.dropped,
            reweighted_groups=self.reweighted,
            uninformative_groups=self.ledger.dropped_uninformative,
            generated_samples=self.generated,
            step_ends=self.step_ends,
            step_train_s=self.step_train_s,
        )


def simulate(cfg: SimConfig) -> SimResult:
    return Simulation(cfg).run()
