r"""The costs the actor-loop simulator (`composer_jax.actor.simulation`) runs on, measured on this
machine two ways (`experiments/simulate_async.py` calls both):
- `calibrate`: each role timed alone through the loop's own InferenceEngine, RLTrainer,
  LocalSampler and grader (what a role costs on hardware of its own);
- `costs_from_traces`: every cost read off traced runs of the real loop, so that it includes
  what shares the machine with each role (what the loop costs on 2 shared cores).
"""

import collections
import dataclasses
import json
import os
import statistics
import tempfile
import time

import numpy as np

from composer_jax.actor.sampler import LocalSampler
from composer_jax.actor.sim_workload import Costs
from composer_jax.actor.trainer import RLTrainer
from composer_jax.envs import builtin_tasks, grade_solution
from composer_jax.infer import InferenceEngine, SamplingParams
from composer_jax.model import init_model
from composer_jax.train.step import split_model
from experiments.bench_throughput import rollout_batch

# ----------------------------------------------------------------- calibration


def _prompts(vocab: int, rows: int, length: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (so that no prefix is shared)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=length).tolist() for _ in range(rows)]


def _engine(model, rl, rows: int):
    buckets = tuple(
        sorted(
            {
                *(b for b in rl.rollout.prefill_buckets if b < rl.rollout.context_len),
                rl.rollout.context_len,
            }
        )
    )
    return InferenceEngine(
        model, num_slots=rows, max_len=rl.rollout.context_len, prefill_buckets=buckets
    )


def decode_step_seconds(model, rl, rows: int, prompt_len: int, steps: int) -> float:
    """Mean seconds of one decode step of an engine of `rows` slots, all running (after two
    untimed steps that compile the prefill and decode shapes)."""
    engine = _engine(model, rl, rows)
    params = SamplingParams(max_new_tokens=steps + 3)
    for prompt in _prompts(model.cfg.vocab_size, rows, prompt_len, seed=rows):
        engine.submit(prompt, params)
    engine.step()
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


def prefill_seconds_per_token(model, rl, rows: int, prompt_len: int) -> float:
    """Seconds per prompt token of prefilling `rows` distinct prompts together: a step that
    admits them minus the plain decode step after it (the second of two rounds: the first
    compiles)."""
    engine = _engine(model, rl, rows)
    params = SamplingParams(max_new_tokens=3)  # the prefill samples one, each step decodes one
    for round_ in range(2):
        for prompt in _prompts(model.cfg.vocab_size, rows, prompt_len, seed=round_):
            engine.submit(prompt, params)
        start = time.perf_counter()
        engine.step()
        admitted = time.perf_counter()
        engine.step()
        decoded = time.perf_counter()
        engine.run()
    return max((admitted - start) - (decoded - admitted), 0.0) / (rows * prompt_len)


def grading_seconds(count: int) -> float:
    """Median seconds to grade one episode of rl_tiny's built-in tasks (the oracle's solution,
    in a fresh sandbox, as every episode gets one)."""
    seconds = []
    for task in builtin_tasks(count, "train", seed=0, max_ops=1):
        start = time.perf_counter()
        grade_solution(task, task.oracle_files, require_isolation=False)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def fit_line(step_seconds: dict[int, float]) -> tuple[float, float]:
    """(seconds per token, seconds per step) of the line through the smallest and the largest
    step (tokens -> seconds; through the origin from a single step), neither below 0."""
    (small, t_small), (large, t_large) = min(step_seconds.items()), max(step_seconds.items())
    per_token = (t_large - t_small) / (large - small) if large > small else t_large / large
    per_token = max(per_token, 0.0)
    return per_token, max(t_large - per_token * large, 0.0)


def _timed_steps(trainer, sampler, batch, steps: int) -> tuple[float, list[float], list[float]]:
    """(fastest step: the least disturbed by other work, publish seconds, rebuild seconds) of
    `steps` steps on `batch` after an untimed one that compiles."""
    trainer.step(batch)
    step_s, publish_s, rebuild_s = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step(batch)
        stepped = time.perf_counter()
        trainer.last_publish.result()
        published = time.perf_counter()
        sampler.sync_weights(wait_for=trainer.version)
        step_s.append(stepped - start)
        publish_s.append(published - stepped)
        rebuild_s.append(time.perf_counter() - published)
    return min(step_s), publish_s, rebuild_s


def trainer_seconds(cfg, workdir: str, steps: int, prompt_len: int) -> dict[str, float]:
    """The trainer's seconds per token and per step (`fit_line` through steps of about half and
    all of groups_per_step x group_size rows of context_len), the publication of each new
    version (compress and write) and a sampler's rebuild of it, all through the loop's own
    RLTrainer and LocalSampler."""
    rl = cfg.rl
    cfg = dataclasses.replace(cfg, workdir=os.path.join(workdir, "run"))
    model = init_model(cfg.model, 0)
    store = os.path.join(workdir, "weights")
    trainer = RLTrainer(cfg, *split_model(model)[1:], store)
    trainer.publish().result()
    sampler = LocalSampler(
        model, store, rl.rollout.num_slots, rl.rollout.context_len, rl.rollout.prefill_buckets
    )
    sampler.sync_weights(wait_for=0)
    sizes = {
        max(rl.rollout.groups_per_step // 2, 1) * rl.rollout.group_size,
        rl.rollout.groups_per_step * rl.rollout.group_size,
    }
    step_s, publish_s, rebuild_s = {}, [], []
    for rows in sorted(sizes):
        batch = rollout_batch(
            model, rows, rl.rollout.context_len, rl.rollout.group_size, prompt_len
        )
        best, publish, rebuild = _timed_steps(trainer, sampler, batch, steps)
        step_s[rows * rl.rollout.context_len] = best
        publish_s += publish
        rebuild_s += rebuild
    trainer.close()
    per_token, overhead = fit_line(step_s)
    return dict(
        train_s_per_token=per_token,
        train_overhead_s=overhead,
        publish_s=statistics.median(publish_s),
        rebuild_s=statistics.median(rebuild_s),
    )


def calibrate(cfg, rows: list[int], steps: int, gradings: int, prompt_len: int) -> Costs:
    """Every cost of `Costs`, measured here with cfg's model and loop settings."""
    model = init_model(cfg.model, 0)
    decode = [decode_step_seconds(model, cfg.rl, r, prompt_len, steps) for r in rows]
    prefill = prefill_seconds_per_token(model, cfg.rl, max(rows), prompt_len)
    with tempfile.TemporaryDirectory() as workdir:
        trainer = trainer_seconds(cfg, workdir, max(2, steps // 4), prompt_len)
    return Costs(
        decode_rows=tuple(rows),
        decode_s=tuple(decode),
        prefill_s_per_token=prefill,
        grading_s=grading_seconds(gradings),
        **trainer,
    )


# ----------------------------------------------------------------- costs from a traced loop


def _interval(event: dict) -> tuple[float, float]:
    return event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6


def _covered(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    """Share of [start, end) that `intervals` cover (counted twice where two overlap)."""
    inside = sum(max(0.0, min(end, e) - max(start, s)) for s, e in intervals)
    return inside / max(end - start, 1e-12)


def costs_from_traces(paths: list[str], cfg, prompt_tokens: float, samples: int) -> Costs:
    """Every cost of `Costs` read off traced runs of the real loop (`--config.rl.trace`; e.g. a
    synchronous and an asynchronous one, so that each role is seen alone and beside the other),
    so that they include what shares the machine with each role (on 2 cores: the environment
    workers, the other role, the host threads), which a calibration of each role alone misses:
    - decode: a line through every decode call's seconds: alone, plus decode_train_s during a
      train step, plus decode_env_s per environment call running beside it (least squares; the
      engine decodes all its slots, so one entry at num_slots), with the sampler thread's host
      work per call (emit, the rollout loop's own work, prefix copies) added to the alone;
    - train: pack + reference + train_step of each step but a run's first, alone (< 10% of it
      beside decoding) and beside decoding (> 50%), per padded token (batch x context_len); the
      ratio is train_slowdown;
    (a kind never seen alone is taken as seen, and its slowdown is 1)
    - environment: the grading per sample (`samples` finished in all runs) from its "step"
      calls alone (< 10% beside decoding, prefill or training) and beside them (> 50%; the
      ratio is env_slowdown), and the mean "start" and "close" calls;
    - prefill per prompt token alone (prefilled rows x `prompt_tokens`), publish, reload, and each
      role's compilations (the most of any run) as its one-off start-up cost; decode and
      prefill calls that compiled are left out of their means."""
    seen = collections.defaultdict(list)
    for path in paths:
        for kind, values in _trace_costs(path).items():
            seen[kind] += values
    mean = statistics.mean
    decode_alone, decode_train_s, decode_env_s = _decode_line(seen["decode"])
    step_alone = mean(seen["step_alone"] or seen["step_shared"])
    rollout = cfg.rl.rollout
    train_tokens = rollout.groups_per_step * rollout.group_size * rollout.context_len
    return Costs(
        decode_rows=(rollout.num_slots,),
        decode_s=(decode_alone + sum(seen["host"]) / len(seen["decode"]),),
        prefill_s_per_token=sum(seen["prefill"]) / (sum(seen["prefill_rows"]) * prompt_tokens),
        train_s_per_token=step_alone / train_tokens,
        publish_s=mean(seen["publish"]),
        rebuild_s=mean(seen["reload"]),
        grading_s=mean(seen["env_alone"] or seen["env_shared"]) * len(seen["env_step"]) / samples,
        env_start_s=mean(seen["start"] or [0.0]),
        env_close_s=mean(seen["close"] or [0.0]),
        train_first_s=max(seen["trainer_compile"]),
        sampler_first_s=max(seen["sampler_compile"]),
        decode_train_s=decode_train_s,
        decode_env_s=decode_env_s,
        train_slowdown=_ratio(seen["step_shared"], seen["step_alone"]),
        env_slowdown=_ratio(seen["env_shared"], seen["env_alone"]),
    )


def _decode_line(calls: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(alone, + during training, + per environment call) seconds of a decode call: the least
    squares line through (seconds, training 0 or 1, environment calls beside it); a term never
    seen varying is 0."""
    seconds, training, env = np.asarray(calls, dtype=float).T
    columns = [np.ones_like(seconds)] + [x for x in (training, env) if np.ptp(x) > 0]
    fit = iter(np.linalg.lstsq(np.stack(columns, axis=1), seconds, rcond=None)[0])
    alone = float(next(fit))
    during = float(next(fit)) if np.ptp(training) > 0 else 0.0
    return alone, during, float(next(fit)) if np.ptp(env) > 0 else 0.0


def _ratio(shared: list[float], alone: list[float]) -> float:
    """Mean shared over mean alone seconds; 1 when either was never seen."""
    return statistics.mean(shared) / statistics.mean(alone) if shared and alone else 1.0


def _trace_costs(path: str) -> dict[str, list[float]]:
    """The seconds `costs_from_traces` pools, of one trace."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    by = collections.defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by[e["cat"]].append(e)
    seconds = lambda e: e["dur"] / 1e6  # noqa: E731
    compiling = [_interval(e) for e in by["compile"]]
    for category in ("decode", "prefill"):  # calls that compiled cost that once
        by[category] = [e for e in by[category] if not _covered(*_interval(e), compiling)]
    training = [_interval(e) for e in by["train_step"] + by["reference"]]
    host = [
        e
        for c in ("emit", "rollout_host", "prefix_copy")
        for e in by[c]
        if names[e["tid"]] == "sampler"
    ]
    decoding = [_interval(e) for e in by["decode"]]
    working = sorted(training + decoding + [_interval(e) for e in by["prefill"]])
    environment = [_interval(e) for e in by["env"]]
    steps = _train_steps(by)[1:]  # the first compiles
    compile_s = collections.Counter()
    for e in by["compile"]:
        compile_s[names[e["tid"]]] += seconds(e)
    env = collections.defaultdict(list)
    for e in by["env"]:
        env[e["name"]].append(e)
    return {
        "decode": [
            (
                seconds(e),
                float(_covered(*_interval(e), training) > 0),
                _covered(*_interval(e), environment),
            )
            for e in by["decode"]
        ],
        "host": [seconds(e) for e in host],
        "prefill": [seconds(e) for e in by["prefill"] if not _covered(*_interval(e), training)],
        "prefill_rows": [
            e["args"].get("rows", 1) for e in by["prefill"] if not _covered(*_interval(e), training)
        ],
        "start": [seconds(e) for e in env["start"]],
        "close": [seconds(e) for e in env["close"]],
        "env_step": [seconds(e) for e in env["step"]],
        "env_alone": [seconds(e) for e in env["step"] if _covered(*_interval(e), working) < 0.1],
        "env_shared": [seconds(e) for e in env["step"] if _covered(*_interval(e), working) > 0.5],
        "step_alone": [t for t, start, end in steps if _covered(start, end, decoding) < 0.1],
        "step_shared": [t for t, start, end in steps if _covered(start, end, decoding) > 0.5],
        "publish": [seconds(e) for e in by["publish"]],
        "reload": [seconds(e) for e in by["weight_reload"] if names[e["tid"]] == "sampler"],
        "trainer_compile": [compile_s["trainer"]],
        "sampler_compile": [compile_s["sampler"]],
    }


def _train_steps(by: dict[str, list[dict]]) -> list[tuple[float, float, float]]:
    """(busy seconds, start, end) of each trainer step: the i-th pack, reference pass (when the
    objective has one) and train_step."""
    kinds = [
        sorted(by[category], key=lambda e: e["ts"])
        for category in ("pack", "reference", "train_step")
        if by[category]
    ]
    steps = []
    for parts in zip(*kinds, strict=True):
        start = min(e["ts"] for e in parts) / 1e6
        end = max(e["ts"] + e["dur"] for e in parts) / 1e6
        steps.append((sum(e["dur"] for e in parts) / 1e6, start, end))
    return steps
