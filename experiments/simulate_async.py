r"""The asynchronous actor loop simulated (`composer_jax.actor.simulation`), and the calibration of
its costs on this machine.

Simulate (seconds for 10^5 episodes), synchronous (max_staleness 0) and asynchronous side by side:

  python -m experiments.simulate_async [--costs=costs.json] [--episodes=100000]
      [--length_median=120 --length_sigma=1.0 | --lengths_file=FILE | --length=192]
      [--max_staleness=2] [--stale_policy=drop] [--noinflight] [--num_samplers=4] ...

The loop's settings default to the preset's (--preset=rl_tiny). Without --costs, the rough rl_tiny
costs of `simulation.Costs`' defaults are used.

Calibrate: measure the costs with the preset's model on this machine and write them to --costs
(decode seconds per step at --calibrate_rows running rows, prefill seconds per prompt token, the
trainer's seconds per token and per step, weight publish and rebuild, grading of the built-in
tasks), through the loop's own InferenceEngine, RLTrainer, LocalSampler and grader; like
sync_vs_async.py, every XLA computation uses one thread unless --multi_thread:

  python -m experiments.simulate_async --calibrate --costs=costs.json
"""

import dataclasses
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
from composer_jax.actor.sampler import LocalSampler
from composer_jax.actor.simulation import Costs, Lengths, SimConfig, Workload
from composer_jax.actor.trainer import RLTrainer
from composer_jax.envs import builtin_tasks, grade_solution
from composer_jax.infer import InferenceEngine, SamplingParams
from composer_jax.model import init_model
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
