r"""The main job's sampler: rollout tokens/s inside its actor loop against the same engine alone.

Issue 18's target compares rollout tokens/s inside the main job with the standalone engine's at
the same slots and lengths. Here both play the main job's own workload from one warm start:

1. Alone: the sampler's engine (rl_tiny's slots, prefill buckets, decode steps per call) plays
   `--groups` of the RL prompts, `group_size` samples each, through the real environments (slots
   refilled as episodes end, environment steps on `rl.rollout.num_env_workers` threads, no trainer),
   with prompt sharing on and, as the baseline, off.
2. In the loop: the main job's RL loop from the same warm start, traced; its sampler's decoded
   tokens over the loop's wall time, for the whole loop and for steps 2+ (after step 1's
   compiles).

  python -m experiments.bench_main_job_sampler [--warm_start=RUN] [--groups=64] [--steps=N]
      [--max_staleness=N] [--groups_per_step=N] [--schedule_ahead_groups=N] [--num_env_workers=N]
"""

import dataclasses
import json
import os
import sys
import time

from absl import app, flags

from composer_jax.trace import SAMPLER

FLAGS = flags.FLAGS


def standalone_rate(cfg, model, tokenizer, tasks, share: bool) -> dict:
    """Tokens/s of the engine alone playing `tasks` in groups (every shape compiled first)."""
    from composer_jax import agent

    rl = cfg.rl
    engine = agent.sampler_engine(model, rl.rollout, tokenizer, share_prefixes=share)
    engine.compile_all()
    workflow, env = agent.build(
        rl.agent,
        tokenizer,
        model.cfg,
        max_len=rl.rollout.context_len,
        sampling=agent.rollout_sampling(rl.rollout, cfg.seed),
        distill=rl.objective.distill_coef > 0,
    )
    start = time.perf_counter()
    outcomes = agent.play(
        engine,
        agent.group_jobs(tasks, rl.rollout.group_size),
        workflow,
        env,
        env_threads=rl.rollout.num_env_workers,
    )
    seconds = time.perf_counter() - start
    tokens = sum(o.policy_tokens for o in outcomes)
    return dict(tokens=tokens, seconds=seconds, rate=tokens / seconds)


def loop_accounting(summary: dict, alone_rate: float) -> list[tuple[str, float]]:
    """Where the loop's sampler time goes against the engine alone, in seconds of the traced
    window: the time its decoded tokens would take alone, then what the loop adds on top (the
    rows sum to the window's wall). A decode call during a train step is charged the difference
    from the mean call outside one (the machine shared with the trainer); the rest of the busy
    time over the alone time is charged to the calls outside train steps: slower than alone
    (fewer rows per call, environment workers on the same cores, host work between calls) or,
    negative, faster (the alone rate counts its prefills and its last, emptying calls)."""
    wall, busy = summary["wall_s"], summary["busy"][SAMPLER]
    ideal = summary["decoded_tokens"] / alone_rate
    during_train = summary["decode_steps_during_train"] * max(
        summary["decode_ms_during_train"] - summary["decode_ms_alone"], 0.0
    ) / 1e3  # fmt: skip
    return [
        ("its tokens at the engine's rate alone", ideal),
        ("decode calls slowed by a train step beside them", during_train),
        ("the other calls' difference from alone (- : faster)", busy * wall - ideal - during_train),
        ("sampler idle (nothing to decode)", (1 - busy) * wall),
    ]


def bench_config():
    """rl_tiny at the flags' rollout settings, traced, its held-out passes cut to one task."""
    from composer_jax import presets

    base = presets.rl_tiny()
    overrides = (
        "group_size",
        "groups_per_step",
        "num_slots",
        "max_new_tokens",
        "max_staleness",
        "schedule_ahead_groups",
        "num_env_workers",
        "skip_uniform_groups",
    )
    rl = dataclasses.replace(
        base.rl,
        # the loop's own held-out passes are not what is measured
        heldout=dataclasses.replace(base.rl.heldout, num_tasks=1, samples=1),
        trace=os.path.join(FLAGS.out, "loop", "trace.json"),
        warm_start_steps=FLAGS.warm_start_steps or base.rl.warm_start_steps,
        rollout=dataclasses.replace(
            base.rl.rollout,
            **{name: FLAGS[name].value for name in overrides if FLAGS[name].value is not None},
        ),
    )
    return dataclasses.replace(
        base, rl=rl, steps=FLAGS.steps or base.steps, workdir=os.path.join(FLAGS.out, "loop")
    )


def report(alone: dict, recorded: dict, num_slots: int) -> None:
    """The rates table (alone, the loop whole and steps 2+), the decode line and where the
    sampler's time goes in steps 2+."""
    from composer_jax.trace import summarize
    from experiments.bench_throughput import steady_summary

    whole = summarize(recorded["traceEvents"], recorded["otherData"]["wall_s"])
    steady = steady_summary(recorded)
    reference = alone[True]["rate"]
    rows = [
        ("engine alone, prompt sharing off", alone[False]["rate"], "", ""),
        ("engine alone, prompt sharing on (the loop's engine)", reference, "", ""),
    ]
    for label, summary in (("in the loop, whole", whole), ("in the loop, steps 2+", steady)):
        rate = summary["decoded_tokens"] / summary["wall_s"]
        rows.append((label, rate, f"{summary['busy'][SAMPLER]:.1%}", f"{summary['wall_s']:.1f}"))
    print("\n| sampler | tokens/s | vs alone (sharing on) | busy | wall s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, rate, busy, wall in rows:
        print(f"| {label} | {rate:.0f} | {rate / reference:.0%} | {busy} | {wall} |")
    print(
        f"\nsteps 2+: {steady['decode_rows_mean']:.1f} of {num_slots} rows per decode call; "
        f"{steady['decode_ms_alone']:.1f} ms per call alone, "
        f"{steady['decode_ms_during_train']:.1f} ms during a train step. Prompt sharing alone: "
        f"{alone[True]['rate'] / alone[False]['rate']:.2f}x. Target: the loop >= 85% of alone.",
        flush=True,
    )
    print("\n| steps 2+: where the sampler's time goes | s | share |\n| --- | ---: | ---: |")
    for label, seconds in loop_accounting(steady, reference):
        print(f"| {label} | {seconds:.1f} | {seconds / steady['wall_s']:.0%} |")


def main(argv):
    del argv
    from absl import logging

    logging.set_verbosity(logging.WARNING)

    from composer_jax import agent
    from composer_jax.actor.run import run_rl
    from composer_jax.actor.setup import rl_task_source, warm_start, warm_start_config
    from composer_jax.train.loop import run_pretraining
    from composer_jax.train.runs import resolve_tokenizer

    cfg = bench_config()
    if os.path.exists(cfg.workdir):
        sys.exit(f"{cfg.workdir} exists: pick another --out")
    warm = FLAGS.warm_start
    if not warm:  # the main job's own warm start, made here
        warm_cfg = warm_start_config(dataclasses.replace(cfg, workdir=FLAGS.out))
        run_pretraining(warm_cfg, sft_examples=agent.sft_examples(warm_cfg))
        warm = warm_cfg.workdir
    cfg = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, warm_start=warm))
    rl = cfg.rl
    model = warm_start(cfg, False)
    tokenizer = resolve_tokenizer(cfg)
    groups = FLAGS.groups or 256 // rl.rollout.group_size
    tasks = rl_task_source(cfg).take(groups, "train", seed=cfg.seed + 1)  # the loop's first prompts

    print(
        f"== 1. The engine alone: {len(tasks)} of the main job's groups x {rl.rollout.group_size} =="
    )
    alone = {share: standalone_rate(cfg, model, tokenizer, tasks, share) for share in (False, True)}
    for share, r in alone.items():
        print(
            f"prompt sharing {'on ' if share else 'off'}: {r['tokens']} tokens in "
            f"{r['seconds']:.1f} s, {r['rate']:.0f} tokens/s",
            flush=True,
        )

    print(f"\n== 2. The main job's actor loop: {cfg.steps} steps, traced ==", flush=True)
    run_rl(cfg, progress=True)
    with open(rl.trace) as f:
        report(alone, json.load(f), rl.rollout.num_slots)


if __name__ == "__main__":
    flags.DEFINE_string("warm_start", "", "The main job's SFT warm start (default: made here).")
    flags.DEFINE_integer(
        "warm_start_steps", None, "SFT steps of the warm start made here (default: the main job's)."
    )
    flags.DEFINE_integer("group_size", None, "Samples per group (default: the main job's).")
    flags.DEFINE_integer("groups_per_step", None, "Groups a step (default: the main job's).")
    flags.DEFINE_integer("num_slots", None, "Sampler slots (default: the main job's).")
    flags.DEFINE_integer("max_new_tokens", None, "Tokens per turn (default: the main job's).")
    flags.DEFINE_integer(
        "max_staleness", None, "Versions a group may lag (default: the main job's)."
    )
    flags.DEFINE_integer(
        "schedule_ahead_groups", None, "Groups started beyond the slots (default: the main job's)."
    )
    flags.DEFINE_integer("num_env_workers", None, "Environment workers (default: the main job's).")
    flags.DEFINE_bool("skip_uniform_groups", None, "Dynamic sampling (off for untrained toys).")
    flags.DEFINE_integer(
        "groups", None, "Groups the engine plays alone (of the RL prompts; default: 256 samples)."
    )
    flags.DEFINE_integer("steps", None, "RL steps of the traced loop (default: the main job's).")
    flags.DEFINE_string("out", "runs/bench_main_job_sampler", "Output folder (must not exist).")
    app.run(main)
