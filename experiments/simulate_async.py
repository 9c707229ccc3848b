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

Calibrate (`experiments/loop_calibration.py`): measure the costs with the preset's model on this
machine and write them to --costs (decode seconds per step at --calibrate_rows running rows,
prefill seconds per prompt token, the trainer's seconds per token and per step, weight publish
and rebuild, grading of the built-in tasks), through the loop's own InferenceEngine, RLTrainer, LocalSampler and grader; like
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
import time

import numpy as np
from absl import app, flags

from composer_jax import presets
from composer_jax.actor import simulation
from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.run import run_rl
from composer_jax.actor.simulation import Costs, Lengths, SimConfig, Workload
from composer_jax.config import RolloutConfig
from composer_jax.train.metrics import read_metrics
from experiments.loop_calibration import calibrate, costs_from_traces

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


# ----------------------------------------------------------------- validation

# The settings validated, as overrides of the main job's rl.rollout: the loop as shipped, the
# synchronous loop, and groups twice as large at the same batch.
SETTINGS = {
    "default": {},
    "sync": {"max_staleness": 0},
    "group8": {"group_size": 8, "groups_per_step": 4},
}
# The traced calibration runs (another seed than the validated runs): each role alone and
# beside the other.
CALIBRATION = {"calibration_sync": {"max_staleness": 0}, "calibration_async": {}}
THROUGHPUT_TOLERANCE = 0.15  # of the predicted samples/s, relative to the measured
STALENESS_TVD_BOUND = 0.15  # total variation distance of the staleness histograms


def setting_config(cfg, name: str, steps: int, directory: str, warm_start: str = "", **rl):
    """The main job's config for one validated setting or calibration run in <directory>/<name>:
    `steps` RL steps, a token held-out check (it runs outside the measured steps), a shared warm
    start (empty: its own) and `rl` fields (trace)."""
    rollout = dataclasses.replace(cfg.rl.rollout, **(SETTINGS | CALIBRATION)[name])
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


def loop_costs(cfg, directory: str, steps: int, warm: str) -> Costs:
    """`--costs` when given, else the costs read by `costs_from_traces` off the CALIBRATION runs
    of the main job's loop, with seed + 1 (in <directory>), saved as <directory>/costs.json."""
    if FLAGS.costs:
        return Costs.load(FLAGS.costs)
    traces, prompts, samples = [], [], 0
    for name in CALIBRATION:
        trace = os.path.abspath(os.path.join(directory, f"{name}.trace.json"))
        run_cfg = setting_config(cfg, name, steps, directory, warm, trace=trace)
        run_cfg = dataclasses.replace(run_cfg, seed=cfg.seed + 1)
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
