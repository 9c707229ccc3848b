r"""What asynchrony buys at cluster scale, answered by the actor-loop simulator with plots.

  python -m experiments.async_at_scale [--out=experiments/figures] [--episodes=20000]

The loop is the kimi_k2 agent at scale: multi-turn episodes (a prompt, turns with lognormal
lengths, tool calls and their outputs between them, then the repository's tests), groups of 8,
64 groups a step, max_staleness 2, a trainer rank per 256 GPUs and samplers of 16 H200 or 8 B200
GPUs each. Its costs come from the roofline (`roofline_costs`: the tensor-core and HBM peaks of
`composer_jax.plan.devices`, fp8 weights on the samplers, the training step of
`experiments/roofline.py`), so every figure is an estimate of the best case, not a measurement;
the simulator itself is validated against real runs on this machine (`simulate_async --validate`).

1. async / sync speed-up as the length tail grows (lognormal sigma, the mean turn held) and as
   samplers are added: where it reaches 2.5x (async_speedup.png);
2. what in-flight weight updates buy: throughput and token lag with and without (inflight.png);
3. the staleness each bound implies: histograms of the trained groups' lag (staleness.png);
4. how many samplers per trainer rank keep the trainer >= 90% busy, H200 and B200
   (samplers_per_trainer.png).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import matplotlib
from absl import app, flags

from composer_jax import presets
from composer_jax.actor import simulation
from composer_jax.actor.simulation import Costs, Lengths, SimConfig, Workload
from composer_jax.config import RLConfig, RolloutConfig
from composer_jax.model import accounting
from composer_jax.plan import devices
from experiments import roofline

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file backend)

FLAGS = flags.FLAGS

# The agent's episode at scale (assumptions, stated with the answers).
PROMPT_TOKENS = 4000
TURNS = 4
MEAN_TURN_TOKENS = 1000
TOOL_S = 2.0  # a tool call's wall time
TOOL_OUTPUT_TOKENS = 500
GRADING_S = 30.0  # the repository's tests in a sandbox
MAX_NEW_TOKENS = 32768
GROUP_SIZE, GROUPS_PER_STEP = 8, 64
SLOTS = 128  # decode rows per sampler (KV cache: 128 x ~12k tokens x 70 kB at MLA's latent)
TRAINER_GPUS = 256  # a trainer rank: the plan's smallest H200 mesh that holds the state
SAMPLER_GPUS = {"H200": 16, "B200": 8}  # fp8 weights (~1 TB) and room for the cache
TRAIN_SEQ_LEN = 16384
SAMPLER_LINK_BYTES_PER_S = 50e9  # per GPU, the scale-out network that carries new weights
THRESHOLD_BUSY = 0.9
MEAN_CONTEXT = PROMPT_TOKENS + TURNS * (MEAN_TURN_TOKENS + TOOL_OUTPUT_TOKENS) / 2


def define_flags() -> None:
    flags.DEFINE_string("out", "experiments/figures", "Where the PNGs go.")
    flags.DEFINE_integer("episodes", 20_000, "Trained episodes per simulated run.")


def sampler_decode_s(model, device, gpus: int, rows: int, context: float) -> float:
    """One decode step of `rows` rows at the roofline: the HBM read of the weights it touches
    (fp8; each MoE layer's experts hit by rows x top-k picks) and of the rows' MLA latent cache,
    or its FLOPs at the fp8 peak, whichever is longer, over `gpus` GPUs."""
    counts = accounting.count_params(model)
    per_expert = counts.routed_experts / (model.num_experts * model.num_moe_layers)
    routed_active = counts.routed_experts * model.num_experts_per_tok / model.num_experts
    other = counts.active - routed_active - counts.embedding
    touched = model.num_experts * (1 - (1 - model.num_experts_per_tok / model.num_experts) ** rows)
    weight_bytes = other + touched * per_expert * model.num_moe_layers
    kv_per_token = model.num_layers * (model.kv_lora_rank + model.qk_rope_head_dim) * 2
    memory_s = (weight_bytes + rows * context * kv_per_token) / (gpus * device.hbm_bytes_per_s)
    compute_s = 2 * counts.active * rows / (gpus * device.peak("fp8"))
    return max(memory_s, compute_s)


def roofline_costs(model, device_name: str, context: float) -> Costs:
    """`Costs` of the kimi_k2 loop on `device_name` at the roofline (see the module docstring):
    decode per rows, prefill at the fp8 peak, the training step per token of one trainer rank
    (with a reference forward: 4/3 of it), publishing the weights over the scale-out network
    and a sampler's reload from HBM."""
    device = devices.by_name(device_name)
    gpus = SAMPLER_GPUS[device_name]
    counts = accounting.count_params(model)
    rows = tuple(2**i for i in range(int(math.log2(SLOTS)) + 1))
    decode = tuple(sampler_decode_s(model, device, gpus, r, context) for r in rows)
    work = roofline.workload(model, TRAIN_SEQ_LEN, 1, devices=TRAINER_GPUS)
    step = roofline.predict(work, device).overlapped_s
    weight_bytes = counts.total  # fp8
    return Costs(
        decode_rows=rows,
        decode_s=decode,
        prefill_s_per_token=2 * counts.active / (gpus * device.peak("fp8")),
        train_s_per_token=(4 / 3) * step / (work.tokens * TRAINER_GPUS),
        publish_s=weight_bytes / (gpus * SAMPLER_LINK_BYTES_PER_S),
        rebuild_s=weight_bytes / gpus / device.hbm_bytes_per_s,
        grading_s=GRADING_S,
    )


def lengths(sigma: float) -> Lengths:
    """Turn lengths with mean MEAN_TURN_TOKENS: lognormal(sigma), or constant at sigma 0."""
    if sigma == 0:
        return Lengths(values=(MEAN_TURN_TOKENS,))
    return Lengths(median=MEAN_TURN_TOKENS / math.exp(sigma**2 / 2), sigma=sigma)


def loop(
    costs: Costs,
    episodes: int,
    sigma: float = 1.0,
    samplers: int = 8,
    staleness: int = 2,
    inflight: bool = True,
    groups_per_step: int = GROUPS_PER_STEP,
    seed: int = 0,
) -> SimConfig:
    """The kimi_k2 loop's SimConfig for about `episodes` trained episodes."""
    rollout = RolloutConfig(
        group_size=GROUP_SIZE,
        groups_per_step=groups_per_step,
        max_staleness=staleness,
        num_slots=SLOTS,
        num_samplers=samplers,
        schedule_ahead_groups=groups_per_step,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    workload = Workload(lengths(sigma), PROMPT_TOKENS, TURNS, TOOL_S, TOOL_OUTPUT_TOKENS)
    return SimConfig(
        rl=RLConfig(rollout=rollout),
        workload=workload,
        costs=costs,
        steps=math.ceil(episodes / (GROUP_SIZE * groups_per_step)),
        inflight_updates=inflight,
        padded_decode=False,
        seed=seed,
    )


def speedup(costs: Costs, episodes: int, sigma: float, samplers: int) -> tuple[float, float]:
    """Asynchronous (max_staleness 2) over synchronous samples/s, and the share of the
    asynchronous run's groups dropped as stale."""
    runs = [
        simulation.simulate(loop(costs, episodes, sigma, samplers, staleness))
        for staleness in (2, 0)
    ]
    dropped = runs[0].dropped_groups * GROUP_SIZE / runs[0].generated_samples
    return runs[0].samples_per_s / runs[1].samples_per_s, dropped


# ----------------------------------------------------------------- the four answers

SIGMAS = (0.0, 0.5, 1.0, 1.5, 2.0)
SAMPLERS = (1, 2, 4, 8, 16, 32)


def answer_speedup(costs: Costs, out: str, episodes: int) -> dict:
    """1. async / sync for each tail and sampler count; the first sigma at which each count
    reaches 2.5x (None: not within SIGMAS); the share of asynchronous groups dropped stale."""
    runs = {n: [speedup(costs, episodes, sigma, n) for sigma in SIGMAS] for n in SAMPLERS}
    table = {n: [ratio for ratio, _ in row] for n, row in runs.items()}
    fig, ax = plt.subplots(figsize=(6, 4))
    for n, ratios in table.items():
        ax.plot(SIGMAS, ratios, marker="o", label=f"{n} samplers")
    ax.axhline(2.5, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("lognormal sigma of turn lengths (mean held)")
    ax.set_ylabel("async / sync samples/s")
    ax.set_title("kimi_k2 on H200 (roofline costs): speed-up of asynchrony")
    ax.legend(fontsize=8)
    _save(fig, out, "async_speedup.png")
    reach = {
        n: next((s for s, r in zip(SIGMAS, ratios) if r >= 2.5), None)
        for n, ratios in table.items()
    }
    dropped = {n: [share for _, share in row] for n, row in runs.items()}
    return {"speedup": table, "reaches_2.5x_at_sigma": reach, "async_dropped_share": dropped}


def answer_inflight(costs: Costs, out: str, episodes: int) -> dict:
    """2. samples/s and mean token lag with in-flight updates on and off, across the tail."""
    runs = {
        flag: [simulation.simulate(loop(costs, episodes, sigma, inflight=flag)) for sigma in SIGMAS]
        for flag in (True, False)
    }
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for flag, results in runs.items():
        label = "in-flight updates" if flag else "drain, then update"
        left.plot(SIGMAS, [r.samples_per_s for r in results], marker="o", label=label)
        right.plot(SIGMAS, [r.token_lag for r in results], marker="o", label=label)
    left.set(xlabel="lognormal sigma", ylabel="samples/s", title="throughput (8 samplers)")
    right.set(xlabel="lognormal sigma", ylabel="versions", title="mean token lag")
    left.legend(fontsize=8)
    _save(fig, out, "inflight.png")
    return {
        "gain": [a.samples_per_s / b.samples_per_s for a, b in zip(runs[True], runs[False])],
        "token_lag_on": [r.token_lag for r in runs[True]],
        "token_lag_off": [r.token_lag for r in runs[False]],
    }


def answer_staleness(costs: Costs, out: str, episodes: int) -> dict:
    """3. the trained groups' lag histogram for each bound (sigma 1, 8 samplers)."""
    settings = {"max_staleness 1": (1, True), "2": (2, True), "4": (4, True)}
    settings["2, no in-flight"] = (2, False)
    hists = {}
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.8 / len(settings)
    for i, (name, (bound, flag)) in enumerate(settings.items()):
        result = simulation.simulate(loop(costs, episodes, 1.0, staleness=bound, inflight=flag))
        total = sum(result.staleness.values())
        hists[name] = {k: v / total for k, v in result.staleness.items()}
        lags = sorted(hists[name])
        ax.bar([k + i * width for k in lags], [hists[name][k] for k in lags], width, label=name)
    ax.set(xlabel="versions behind the trainer", ylabel="share of trained groups")
    ax.set_title("staleness of trained groups (sigma 1, 8 samplers)")
    ax.legend(fontsize=8)
    _save(fig, out, "staleness.png")
    return hists


SAMPLER_COUNTS = {"H200": (8, 16, 24, 32, 40, 48, 56, 64), "B200": tuple(range(16, 129, 16))}


def answer_samplers(model, out: str, counts: dict[str, tuple[int, ...]] = SAMPLER_COUNTS) -> dict:
    """4. the trainer's busy share against samplers per trainer rank, on H200 and B200; the
    fewest samplers that keep it >= 90% busy. With max_staleness 2 the episodes in flight are
    about three batches, so a fixed batch caps what samplers can add; here the batch grows with
    the samplers (as many episodes as their slots hold), and the busy share is read after the
    first 3 of 10 steps (past the pipeline's fill)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    result = {}
    for name in SAMPLER_GPUS:
        costs = roofline_costs(model, name, MEAN_CONTEXT)
        busy = []
        for n in counts[name]:
            groups = n * SLOTS // GROUP_SIZE
            sim = loop(costs, 10 * groups * GROUP_SIZE, 1.0, n, groups_per_step=groups)
            busy.append(simulation.simulate(sim).trainer_busy_after(3))
        enough = next((n for n, b in zip(counts[name], busy) if b >= THRESHOLD_BUSY), None)
        result[name] = {"busy": dict(zip(counts[name], busy)), "samplers_for_90%": enough}
        ax.plot(
            counts[name], busy, marker="o", label=f"{name} ({SAMPLER_GPUS[name]} GPUs / sampler)"
        )
    ax.axhline(THRESHOLD_BUSY, color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="samplers per trainer rank (256 GPUs)", ylabel="trainer busy share")
    ax.set_title("kimi_k2 at the roofline: samplers a trainer rank needs")
    ax.legend(fontsize=8)
    _save(fig, out, "samplers_per_trainer.png")
    return result


def _save(fig, out: str, name: str) -> None:
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=110)
    plt.close(fig)
    print(f"wrote {os.path.join(out, name)}")


def main(argv):
    del argv
    os.makedirs(FLAGS.out, exist_ok=True)
    model = presets.kimi_k2().model
    costs = roofline_costs(model, "H200", MEAN_CONTEXT)
    print(f"H200 roofline costs: {costs}")
    start = time.perf_counter()
    result = simulation.simulate(loop(costs, 100_000, 1.0, 8))
    print(
        f"one simulated run: {result.trained_samples} episodes in "
        f"{time.perf_counter() - start:.1f} s; {result.samples_per_s:.2f} samples/s"
    )
    answers = {
        answer.__name__: answer(costs, FLAGS.out, FLAGS.episodes)
        for answer in (answer_speedup, answer_inflight, answer_staleness)
    }
    answers["answer_samplers"] = answer_samplers(model, FLAGS.out)
    for name, value in answers.items():
        print(name, value)
    with open(os.path.join(FLAGS.out, "async_at_scale.json"), "w") as f:
        json.dump(answers, f, indent=1, default=str)
    sys.stdout.flush()


if __name__ == "__main__":
    define_flags()
    app.run(main)
