r"""Synchronous vs asynchronous RL on the same workload: throughput ratio and staleness histogram.

Both runs start from the same warm-start checkpoint and use the same prompts, group size, batch,
sampling and seed; only the scheduling differs:
  sync   max_staleness=0: the sampler waits for each new policy, the trainer for each batch
  async  max_staleness=K: generation runs ahead while the trainer trains; weights are updated
         in flight and groups more than K versions stale are dropped
Throughput is trained samples per second over steps 2..N (step 1 includes compilation). The
trainer's and sampler's XLA computations each use one thread (`--xla_cpu_multi_thread_eigen=false`),
as they would each own an accelerator on a cluster; pass --multi_thread to let them share cores.

  python experiments/sync_vs_async.py --steps=12 [--warm_start=runs/rl_tiny/warm_start]
"""

import os
import sys

from absl import app, flags

_STEPS = flags.DEFINE_integer("steps", 12, "RL steps per run.")
_STALENESS = flags.DEFINE_integer("max_staleness", 2, "Bound of the asynchronous run.")
_WARM = flags.DEFINE_string("warm_start", "", "A warm-start run (default: a short SFT here).")
_OUT = flags.DEFINE_string("out", "runs/sync_vs_async", "Output folder.")
_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 160, "Tokens per turn.")
_MULTI = flags.DEFINE_bool("multi_thread", False, "Let XLA use every core per computation.")


def _run(base, name: str, max_staleness: int, warm: str):
    import dataclasses

    from composer_jax.actor.run import run_rl

    rl = dataclasses.replace(
        base.rl,
        rollout=dataclasses.replace(base.rl.rollout, max_staleness=max_staleness),
        warm_start=warm,
    )
    cfg = dataclasses.replace(base, rl=rl, workdir=os.path.join(_OUT.value, name))
    return run_rl(cfg, progress=True)


def workload():
    """rl_tiny at the workload of experiments/RESULTS.md: groups of 8, a 400-step warm start,
    every group trained (a fixed workload per step)."""
    import dataclasses

    from composer_jax import presets

    base = presets.rl_tiny()
    return dataclasses.replace(
        base,
        steps=_STEPS.value,
        rl=dataclasses.replace(
            base.rl,
            rollout=dataclasses.replace(
                base.rl.rollout,
                max_new_tokens=_NEW_TOKENS.value,
                group_size=8,
                num_slots=16,
                skip_uniform_groups=False,
                num_prompts=0,
            ),
            heldout=dataclasses.replace(base.rl.heldout, num_tasks=2, samples=1),
            warm_start_steps=400,
        ),
    )


def _warm_start(base) -> str:
    """--warm_start, else a short SFT run here (made once, then reused)."""
    import dataclasses

    from composer_jax.actor.setup import warm_start_config

    if _WARM.value:
        return _WARM.value
    warm_cfg = warm_start_config(dataclasses.replace(base, workdir=_OUT.value))
    if not os.path.exists(os.path.join(warm_cfg.workdir, "checkpoints")):
        from composer_jax import agent
        from composer_jax.train import run_pretraining

        run_pretraining(warm_cfg, sft_examples=agent.sft_examples(warm_cfg))
    return warm_cfg.workdir


def summarize(metrics: list[dict], samples_per_step: int, histogram: dict) -> dict:
    """One run's steps 2+ (step 1 compiles): throughput, step times, staleness, reward."""
    import numpy as np

    lines = [m for m in metrics if "staleness_mean" in m and m["step"] >= 2]  # step records
    seconds = sum(m["seconds_per_step"] for m in lines)
    return dict(
        seconds=seconds,
        samples_per_s=len(lines) * samples_per_step / seconds,
        train=np.mean([m["train_seconds"] for m in lines]),
        wait=np.mean([m["wait_seconds"] for m in lines]),
        staleness=np.mean([m["staleness_mean"] for m in lines]),
        dropped=sum(m["groups_dropped_stale"] for m in lines),
        histogram=histogram,
        # A step whose every sample was abandoned measured no reward.
        reward=np.mean([m["reward_mean"] for m in lines if "reward_mean" in m]),
    )


def report(results: dict[str, dict], samples_per_step: int) -> None:
    print(f"\n{_STEPS.value} steps x {samples_per_step} samples")
    header = "mode   | s (steps 2+) | samples/s | train s/step | wait s/step | staleness | dropped"
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        print(
            f"{name:6} | {r['seconds']:12.1f} | {r['samples_per_s']:9.2f} | {r['train']:12.2f} |"
            f" {r['wait']:11.2f} | {r['staleness']:9.2f} | {int(r['dropped']):7d}"
        )
    ratio = results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]
    gen, train = results["sync"]["wait"], results["sync"]["train"]
    print(
        f"\nsync: generation {gen:.2f} s/step vs training {train:.2f} s/step "
        f"(ratio {gen / max(train, 1e-9):.2f})"
    )
    print(f"async / sync throughput: {ratio:.2f}x")
    histogram = dict(sorted(results["async"]["histogram"].items()))
    print(f"async staleness histogram (versions: groups): {histogram}")
    sys.stdout.flush()


def main(argv):
    del argv
    import shutil

    from absl import logging

    from composer_jax.train.metrics import read_metrics

    logging.set_verbosity(logging.WARNING)
    base = workload()
    warm = _warm_start(base)
    samples_per_step = base.rl.rollout.groups_per_step * base.rl.rollout.group_size
    results = {}
    for name, staleness in (("sync", 0), ("async", _STALENESS.value)):
        shutil.rmtree(os.path.join(_OUT.value, name), ignore_errors=True)
        result = _run(base, name, staleness, warm)
        metrics = read_metrics(os.path.join(_OUT.value, name, "metrics.jsonl"))
        results[name] = summarize(metrics, samples_per_step, result.staleness_histogram)
    report(results, samples_per_step)


if __name__ == "__main__":
    if "--multi_thread" not in sys.argv:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
        ).strip()
    app.run(main)
