r"""The asynchronous actor loop simulated (`composer_jax.actor.simulation`), and the calibration of
its costs on this machine.

Simulate (seconds for 10^5 episodes), synchronous (max_staleness 0) and asynchronous side by side:

  python -m experiments.simulate_async [--costs=costs.json] [--episodes=100000]
      [--length_median=120 --length_sigma=1.0 | --lengths_file=FILE | --length=192]
      [--max_staleness=2] [--stale_policy=drop] [--noinflight] [--num_samplers=4] ...

The loop's settings default to the preset's (--preset=rl_tiny). Without --costs, the rough rl_tiny
costs of `simulation.Costs`' defaults are used.

Validate: run three settings of the main job's loop for real on this machine (the rl_tiny preset
as `launch.rl` runs it; then max_staleness 0; then groups of 8 at the same batch), simulate each
with costs calibrated here and the run's own generation lengths, and compare samples/s (steps 2+)
within 15% and the staleness histogram of the trained groups within a total variation distance
of 0.15; exits 1 when a prediction misses (the real runs and costs are kept in --validate_dir and
reused by a second call):

  python -m experiments.simulate_async --validate [--validate_dir=runs/simulate_async]

Calibrate: measure the costs with the preset's model on this machine and write them to --costs
(decode seconds per step at --calibrate_rows running rows, prefill seconds per prompt token, the
trainer's seconds per token and per step, weight publish and rebuild, grading of the built-in
tasks), through the loop's own InferenceEngine, RLTrainer, LocalSampler and grader; like
sync_vs_async.py, every XLA computation uses one thread unless --multi_thread:

  python -m experiments.simulate_async --calibrate --costs=costs.json
"""

import collections
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from composer_jax import presets
from composer_jax.actor import simulation
from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.run import run_rl
from composer_jax.actor.sampler import LocalSampler
from composer_jax.actor.simulation import Costs, Lengths, SimConfig, Workload
from composer_jax.actor.trainer import RLTrainer
from composer_jax.config import RolloutConfig
from composer_jax.envs import builtin_tasks, grade_solution
from composer_jax.infer import InferenceEngine, SamplingParams
from composer_jax.model import init_model
from composer_jax.train.metrics import read_metrics
from composer_jax.train.step import split_model
from experiments.bench_throughput import rollout_batch

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line (defined only when run, so that tests can import this module)."""
    flags.DEFINE_string("preset", "rl_tiny", "The preset whose model and loop are simulated.")
    flags.DEFINE_string("costs", "", "Costs JSON to read (written by --calibrate).")
    flags.DEFINE_bool("calibrate", False, "Measure the costs and write them to --costs.")
    flags.DEFINE_enum("mode", "both", ["both", "sync", "async"], "Which loops to simulate.")
    flags.DEFINE_integer("episodes", 100_000, "Trained episodes per simulated run.")
    flags.DEFINE_integer("seed", 0, "Seed of the generation lengths.")
    # The loop (default: the preset's).
    flags.DEFINE_integer("group_size", None, "Samples per group.")
    flags.DEFINE_integer("groups_per_step", None, "Groups per trainer step.")
    flags.DEFINE_integer("num_slots", None, "Slots per sampler.")
    flags.DEFINE_integer("num_samplers", None, "Samplers.")
    flags.DEFINE_integer("schedule_ahead_groups", None, "Groups scheduled beyond the slots.")
    flags.DEFINE_integer("max_staleness", None, "The asynchronous run's bound.")
    flags.DEFINE_enum("stale_policy", None, ["drop", "reweight"], "Stale groups' fate.")
    flags.DEFINE_integer("max_new_tokens", None, "Token budget of a turn (caps lengths).")
    flags.DEFINE_integer("trainer_ranks", 1, "Data-parallel trainer ranks.")
    flags.DEFINE_bool("inflight", True, "Weight updates land between decode steps.")
    flags.DEFINE_bool(
        "padded_decode",
        True,
        "Decode steps cost num_slots rows (the shipped engine's fixed shape).",
    )
    flags.DEFINE_bool(
        "padded_train",
        True,
        "Steps train groups_per_step x group_size rows of context_len at least.",
    )
    # The workload.
    flags.DEFINE_integer("prompt_tokens", 280, "Prompt tokens per episode.")
    flags.DEFINE_integer("length", 0, "Constant tokens per turn (0: max_new_tokens).")
    flags.DEFINE_string("lengths_file", "", "Whitespace-separated turn lengths.")
    flags.DEFINE_float("length_median", 0.0, "Lognormal turn lengths: their median.")
    flags.DEFINE_float("length_sigma", 0.0, "Lognormal turn lengths: sigma (> 0 turns on).")
    flags.DEFINE_integer("turns", 1, "Generations per episode.")
    flags.DEFINE_float("tool_s", 0.0, "Tool seconds between two turns.")
    flags.DEFINE_integer("tool_output_tokens", 0, "Tool output prefilled per turn.")
    # The calibration.
    flags.DEFINE_list("calibrate_rows", ["1", "2", "4", "8", "16", "32"], "Decode rows.")
    flags.DEFINE_integer("calibrate_steps", 16, "Timed decode / train repetitions.")
    flags.DEFINE_integer("calibrate_gradings", 8, "Built-in tasks graded.")
    flags.DEFINE_bool("multi_thread", False, "Let XLA use every core per computation.")
    # The validation.
    flags.DEFINE_bool("validate", False, "Run the main job's loop for real and compare.")
    flags.DEFINE_string("validate_dir", "runs/simulate_async", "Real runs, costs and report.")
    flags.DEFINE_integer("validate_steps", 16, "RL steps of each real run.")
    flags.DEFINE_integer("validate_seeds", 16, "Simulated runs averaged per setting.")


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


# ----------------------------------------------------------------- validation

# The settings validated, as overrides of the main job's rl.rollout: the loop as shipped, the
# synchronous loop, and groups twice as large at the same batch.
SETTINGS = {
    "default": {},
    "sync": {"max_staleness": 0},
    "group8": {"group_size": 8, "groups_per_step": 4},
}
THROUGHPUT_TOLERANCE = 0.15  # of the predicted samples/s, relative to the measured
STALENESS_TVD_BOUND = 0.15  # total variation distance of the staleness histograms


def setting_config(cfg, name: str, steps: int, directory: str, warm_start: str = "", **rl):
    """The main job's config for one validated setting in <directory>/<name>: `steps` RL steps,
    a token held-out check (it runs outside the measured steps), a shared warm start (empty:
    its own) and `rl` fields (trace)."""
    rollout = dataclasses.replace(cfg.rl.rollout, **SETTINGS.get(name, {}))
    heldout = dataclasses.replace(cfg.rl.heldout, num_tasks=2, samples=1)
    rl_cfg = dataclasses.replace(
        cfg.rl, rollout=rollout, heldout=heldout, warm_start=warm_start, **rl
    )
    return dataclasses.replace(cfg, rl=rl_cfg, steps=steps, workdir=os.path.join(directory, name))


def sample_tokens(arrays: dict) -> tuple[np.ndarray, np.ndarray]:
    """(generated, other) tokens of each sample of a packed ledger group: its policy tokens,
    and the rest (prompt, tool outputs)."""
    lengths, samples = arrays["sequence_lengths"], arrays["sequence_sample"]
    mask = arrays["policy_mask"][: lengths.sum()]
    policy = np.add.reduceat(mask.astype(int), np.cumsum(lengths) - lengths)
    count = int(samples.max()) + 1
    generated = np.bincount(samples, weights=policy, minlength=count)
    return generated, np.bincount(samples, weights=lengths - policy, minlength=count)


def measure_run(cfg, staleness: dict[int, int]) -> dict:
    """What a finished real run of `cfg` gave: samples/s over steps 2+ (its trained samples over
    the wall time from step 1's end: step 1 compiles), the staleness histogram of its trained
    groups, and its workload: every finished sample's generated tokens, the mean prompt tokens,
    the share of groups whose task rewards are all equal."""
    rollout = cfg.rl.rollout
    records = read_metrics(os.path.join(cfg.workdir, "metrics.jsonl"))
    later = [m for m in records if "seconds_per_step" in m and m["step"] >= 2]
    ledger = GroupLedger(os.path.join(cfg.workdir, "ledger"))
    lengths, prompts, uniform = [], [], 0
    for group_id in ledger:
        group = ledger.load(group_id)
        generated, other = sample_tokens(group.arrays)
        lengths += generated.astype(int).tolist()
        prompts += other.tolist()
        uniform += bool(np.ptp(group.rewards) == 0)
    samples = len(later) * rollout.groups_per_step * rollout.group_size
    return dict(
        samples_per_s=samples / sum(m["seconds_per_step"] for m in later),
        staleness={int(k): int(v) for k, v in staleness.items()},
        lengths=lengths,
        prompt_tokens=float(np.mean(prompts)),
        uniform_fraction=uniform / max(len(prompts) // rollout.group_size, 1),
    )


def predict(rl, steps: int, costs: Costs, measured: dict, seeds: int) -> dict:
    """The simulator's samples/s (steps 2+) and staleness histogram for a real run of `steps`
    steps of the loop `rl`, from `costs` and the run's own workload: the mean of `seeds`
    simulated runs (the real run is one draw of them)."""
    workload = Workload(
        Lengths(values=tuple(measured["lengths"])),
        prompt_tokens=round(measured["prompt_tokens"]),
        uniform_fraction=measured["uniform_fraction"],
    )
    batch = rl.rollout.groups_per_step * rl.rollout.group_size
    rates, staleness = [], collections.Counter()
    for seed in range(seeds):
        sim = SimConfig(
            rl=rl,
            workload=workload,
            costs=costs,
            steps=steps,
            min_train_tokens=batch * rl.rollout.context_len,
            env_workers=rl.rollout.num_env_workers,
            seed=seed,
        )
        result = simulation.simulate(sim)
        rates.append(result.samples_per_s_after(1))
        staleness.update(result.staleness)
    return dict(samples_per_s=float(np.mean(rates)), staleness=dict(sorted(staleness.items())))


def total_variation(a: dict[int, int], b: dict[int, int]) -> float:
    """Total variation distance of two histograms, each normalised."""
    total_a, total_b = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a.get(k, 0) / total_a - b.get(k, 0) / total_b) for k in {*a, *b})


def compare(measured: dict, predicted: dict) -> dict:
    """The prediction's errors and whether each is within its bound."""
    error = predicted["samples_per_s"] / measured["samples_per_s"] - 1
    tvd = total_variation(measured["staleness"], predicted["staleness"])
    return dict(
        throughput_error=error,
        staleness_tvd=tvd,
        ok=abs(error) <= THROUGHPUT_TOLERANCE and tvd <= STALENESS_TVD_BOUND,
    )


def real_run(cfg) -> dict:
    """`measure_run` of cfg's run, run now unless its measurement is saved already."""
    path = os.path.join(cfg.workdir, "measured.json")
    if os.path.exists(path):
        with open(path) as f:
            measured = json.load(f)
        measured["staleness"] = {int(k): v for k, v in measured["staleness"].items()}
        return measured
    result = run_rl(cfg, progress=True)
    measured = measure_run(cfg, result.staleness_histogram)
    with open(path, "w") as f:
        json.dump(measured, f)
    return measured


# The traced calibration runs (another seed than the validated runs): each role alone and
# beside the other.
CALIBRATION = {"calibration_sync": {"max_staleness": 0}, "calibration_async": {}}


def loop_costs(cfg, directory: str, steps: int, warm: str) -> Costs:
    """`--costs` when given, else the costs read by `costs_from_traces` off the CALIBRATION runs
    of the main job's loop, with seed + 1 (in <directory>), saved as <directory>/costs.json."""
    if FLAGS.costs:
        return Costs.load(FLAGS.costs)
    traces, prompts, samples = [], [], 0
    for name, rollout in CALIBRATION.items():
        trace = os.path.abspath(os.path.join(directory, f"{name}.trace.json"))
        run_cfg = setting_config(cfg, name, steps, directory, warm, trace=trace)
        run_cfg = dataclasses.replace(
            run_cfg,
            seed=cfg.seed + 1,
            rl=dataclasses.replace(
                run_cfg.rl, rollout=dataclasses.replace(run_cfg.rl.rollout, **rollout)
            ),
        )
        measured = real_run(run_cfg)
        traces.append(trace)
        prompts.append(measured["prompt_tokens"])
        samples += len(measured["lengths"])
    costs = costs_from_traces(traces, cfg, statistics.mean(prompts), samples)
    costs.dump(os.path.join(directory, "costs.json"), preset=FLAGS.preset, traces=traces)
    return costs


def validate(cfg, directory: str, steps: int, seeds: int) -> bool:
    """Each setting run for real (the first with its own warm start, the others and the
    calibration run from it) and simulated; the report printed and saved as
    <directory>/validation.json."""
    os.makedirs(directory, exist_ok=True)
    default = setting_config(cfg, "default", steps, directory)
    real_run(default)  # with its own warm start, which the other runs share
    warm = os.path.join(default.workdir, "warm_start")
    costs = loop_costs(cfg, directory, steps, warm)
    report_data = {"costs": dataclasses.asdict(costs), "steps": steps, "settings": {}}
    for name in SETTINGS:
        run_cfg = (
            default if name == "default" else setting_config(cfg, name, steps, directory, warm)
        )
        measured = real_run(run_cfg)  # the default's is read back
        predicted = predict(run_cfg.rl, steps, costs, measured, seeds)
        report_data["settings"][name] = dict(
            rollout=dataclasses.asdict(run_cfg.rl.rollout),
            measured=measured,
            predicted=predicted,
            **compare(measured, predicted),
        )
    with open(os.path.join(directory, "validation.json"), "w") as f:
        json.dump(report_data, f)
    return print_validation(report_data)


def read_validation(path: str) -> dict:
    """A validation.json as `validate` wrote it, histograms keyed by int again."""
    with open(path) as f:
        data = json.load(f)
    for row in data["settings"].values():
        for part in ("measured", "predicted"):
            row[part]["staleness"] = {int(k): v for k, v in row[part]["staleness"].items()}
    return data


def repredict(data: dict, seeds: int) -> dict:
    """Each recorded real run predicted again by the simulator as it is now, compared."""
    costs = Costs.from_dict(data["costs"])
    out = {}
    for name, row in data["settings"].items():
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in row["rollout"].items()}
        rollout = dataclasses.replace(RolloutConfig(), **fields)
        rl = dataclasses.replace(presets.rl_tiny().rl, rollout=rollout)
        predicted = predict(rl, data["steps"], costs, row["measured"], seeds)
        out[name] = dict(predicted=predicted, **compare(row["measured"], predicted))
    return out


def print_validation(report_data: dict) -> bool:
    """The table of predicted vs measured figures; whether every prediction is within bounds."""
    header = (
        "setting | samples/s measured | predicted | error  | staleness measured -> predicted"
        " | TVD  | within bounds"
    )
    print(header)
    print("-" * len(header))
    for name, row in report_data["settings"].items():
        measured, predicted = row["measured"], row["predicted"]
        shares = [
            {k: round(v / sum(h.values()), 2) for k, v in sorted(h.items())}
            for h in (measured["staleness"], predicted["staleness"])
        ]
        print(
            f"{name:7} | {measured['samples_per_s']:18.2f} | {predicted['samples_per_s']:9.2f} |"
            f" {row['throughput_error']:+6.1%} | {shares[0]} -> {shares[1]} |"
            f" {row['staleness_tvd']:.2f} | {'yes' if row['ok'] else 'NO'}"
        )
    return all(row["ok"] for row in report_data["settings"].values())


# ----------------------------------------------------------------- simulation


def sim_config(cfg, costs: Costs, staleness: int) -> SimConfig:
    """The flags over the preset's loop, at max_staleness `staleness`."""
    rl = cfg.rl
    overrides = {
        "group_size": FLAGS.group_size,
        "groups_per_step": FLAGS.groups_per_step,
        "num_slots": FLAGS.num_slots,
        "num_samplers": FLAGS.num_samplers,
        "schedule_ahead_groups": FLAGS.schedule_ahead_groups,
        "stale_policy": FLAGS.stale_policy,
        "max_new_tokens": FLAGS.max_new_tokens,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    rollout = dataclasses.replace(rl.rollout, **given, max_staleness=staleness)
    rl = dataclasses.replace(rl, rollout=rollout)
    if FLAGS.lengths_file:
        lengths = Lengths.from_file(FLAGS.lengths_file)
    elif FLAGS.length_sigma > 0:
        lengths = Lengths(
            median=FLAGS.length_median or rl.rollout.max_new_tokens / 2, sigma=FLAGS.length_sigma
        )
    else:
        lengths = Lengths(values=(FLAGS.length or rl.rollout.max_new_tokens,))
    workload = Workload(
        lengths, FLAGS.prompt_tokens, FLAGS.turns, FLAGS.tool_s, FLAGS.tool_output_tokens
    )
    batch = rl.rollout.groups_per_step * rl.rollout.group_size
    return SimConfig(
        rl=rl,
        workload=workload,
        costs=costs,
        steps=math.ceil(FLAGS.episodes / batch),
        trainer_ranks=FLAGS.trainer_ranks,
        min_train_tokens=batch * rl.rollout.context_len if FLAGS.padded_train else 0,
        inflight_updates=FLAGS.inflight,
        padded_decode=FLAGS.padded_decode,
        seed=FLAGS.seed,
    )


def report(results: dict[str, tuple[simulation.SimResult, float]]) -> None:
    """A row per simulated loop (wall s: the simulation's own time), then the staleness."""
    header = (
        "mode  | samples/s | trainer busy | sampler busy | slot use | token lag | dropped "
        "| reweighted | simulated s | wall s"
    )
    print(header)
    print("-" * len(header))
    for name, (r, wall) in results.items():
        print(
            f"{name:5} | {r.samples_per_s:9.2f} | {r.trainer_busy:12.1%} | {r.sampler_busy:12.1%}"
            f" | {r.slot_use:8.1%} | {r.token_lag:9.2f} | {r.dropped_groups:7d}"
            f" | {r.reweighted_groups:10d} | {r.seconds:11.0f} | {wall:6.2f}"
        )
    for name, (r, _) in results.items():
        print(f"{name} staleness of trained groups (versions: groups): {r.staleness}")
    if len(results) == 2:
        ratio = results["async"][0].samples_per_s / results["sync"][0].samples_per_s
        print(f"async / sync throughput: {ratio:.2f}x")


def main(argv):
    del argv
    cfg = getattr(presets, FLAGS.preset)()
    if FLAGS.validate:
        ok = validate(cfg, FLAGS.validate_dir, FLAGS.validate_steps, FLAGS.validate_seeds)
        sys.stdout.flush()
        sys.exit(0 if ok else 1)
    if FLAGS.calibrate:
        if not FLAGS.costs:
            raise app.UsageError("--calibrate writes its costs to --costs=FILE")
        rows = [int(r) for r in FLAGS.calibrate_rows]
        costs = calibrate(
            cfg, rows, FLAGS.calibrate_steps, FLAGS.calibrate_gradings, FLAGS.prompt_tokens
        )
        costs.dump(FLAGS.costs, preset=FLAGS.preset, prompt_tokens=FLAGS.prompt_tokens)
        print(f"wrote {FLAGS.costs}: {costs}")
        return
    costs = Costs.load(FLAGS.costs) if FLAGS.costs else Costs()
    bound = cfg.rl.rollout.max_staleness if FLAGS.max_staleness is None else FLAGS.max_staleness
    modes = {"sync": 0, "async": bound}
    results = {}
    for name, staleness in modes.items():
        if FLAGS.mode in ("both", name):
            start = time.perf_counter()
            result = simulation.simulate(sim_config(cfg, costs, staleness))
            results[name] = (result, time.perf_counter() - start)
    report(results)
    sys.stdout.flush()


if __name__ == "__main__":
    define_flags()
    if "--multi_thread" not in sys.argv:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
        ).strip()
    app.run(main)
