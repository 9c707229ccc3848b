r"""What a change to the agent's warm start does to its held-out skill, before any RL.

  python experiments/agent_levers.py --lever=baseline --config=rl_agent_tiny \
      --config.workdir=runs/levers/baseline [--config.X=...] [--num_tasks=32 --samples=8]

Runs the config's warm start (`rl.warm_start_steps` of its SFT phases in `<workdir>/warm_start`,
as `launch.rl` would; a finished one is reused), then evaluates it as `launch.evaluate` does
(`eval.tasks.evaluate_tasks`): `--samples` episodes at the RL temperature on each of
`--num_tasks` held-out tasks neither SFT nor the RL run would see, the per-stage breakdown
(`agent.stages`) included. Appends one row to `--table` (JSONL: the lever, the overrides,
pass@1 and best-of-K with their 95% intervals, where the episodes stopped, wall times) and prints
it as a markdown row for experiments/RESULTS.md's lever table.
"""

import json
import os
import sys
import time

from absl import flags

from launch import cli

_CONFIG = cli.define_config("rl_agent_tiny")
_LEVER = flags.DEFINE_string("lever", None, "The row's name in the lever table.", required=True)
_NUM_TASKS = flags.DEFINE_integer("num_tasks", 32, "Held-out tasks.")
_SAMPLES = flags.DEFINE_integer("samples", 8, "Episodes per task.")
_TABLE = flags.DEFINE_string("table", "runs/levers/levers.jsonl", "The JSONL table to append to.")


def _evaluate(cfg, out: str) -> dict:
    """`launch.evaluate`'s report (the same `evaluate_tasks`) of the warm start on the RL run's
    held-out tasks: those neither its SFT nor its RL prompts hold (drawn by the RL config, whose
    prompts the warm start's own config cannot know); an existing report is reused."""
    if os.path.isfile(out):
        with open(out) as f:
            return json.load(f)
    from composer_jax.actor.setup import rl_task_source, untrained_tasks
    from composer_jax.agent.stages import format_stages
    from composer_jax.eval import format_table
    from composer_jax.eval.tasks import TaskEvalConfig, evaluate_tasks
    from composer_jax.train import load_run

    run = load_run(os.path.join(cfg.workdir, "warm_start"))
    rl, k = cfg.rl, _SAMPLES.value
    tasks = untrained_tasks(cfg, rl_task_source(cfg), rl.heldout.split, _NUM_TASKS.value)
    settings = TaskEvalConfig(
        samples=k,
        ks=(1, k),
        temperature=rl.rollout.temperature,
        max_turns=rl.agent.max_turns,
        max_new_tokens=rl.rollout.max_new_tokens,
        context_len=rl.rollout.context_len,
        num_slots=max(rl.rollout.num_slots, k),
        seed=cfg.seed,
        require_isolation=rl.agent.require_sandbox,
    )
    report = evaluate_tasks(run.model, run.tokenizer, tasks, settings, rl, progress=False)
    with open(out, "w") as f:
        json.dump(report, f)
    print(format_table(report))
    print(format_stages(report["stages"]), flush=True)
    return report


def _row(cfg, report: dict, seconds: dict) -> dict:
    summary, k = report["summary"], _SAMPLES.value
    return {
        "lever": _LEVER.value,
        "overrides": [a for a in sys.argv[1:] if a.startswith("--config")],
        "workdir": cfg.workdir,
        "tasks": summary["tasks"],
        "samples": k,
        "pass@1": [summary["pass@1"], summary["pass@1_ci95"]],
        f"best_of_{k}": [summary[f"best_of_{k}"], summary[f"best_of_{k}_ci95"]],
        "reward": [summary["mean_reward"], summary["mean_reward_ci95"]],
        "turns": summary["mean_turns"],
        "tool_calls": summary["mean_tool_calls"],
        "stages": report["stages"],
        "seconds": seconds,
    }


def _markdown(row: dict) -> str:
    k = row["samples"]
    failed = row["stages"]["failed_at"]
    stopped = ", ".join(f"{stage} {n}" for stage, n in failed.items() if n)
    p, pc = row["pass@1"]
    b, bc = row[f"best_of_{k}"]
    return (
        f"| {row['lever']} | {p:.3f} +- {pc:.3f} | {b:.3f} +- {bc:.3f} | {row['turns']:.1f} | "
        f"{stopped} | {row['seconds']['warm_start']:.0f} s |"
    )


def main(argv):
    del argv
    cfg = cli.experiment_config(_CONFIG)
    from launch import runtime

    runtime.initialize()
    from composer_jax.actor.setup import warm_start

    begun = time.monotonic()
    warm_start(cfg, progress=False)
    trained = time.monotonic()
    report = _evaluate(cfg, os.path.join(cfg.workdir, "eval_levers.json"))
    seconds = {"warm_start": trained - begun, "evaluate": time.monotonic() - trained}
    row = _row(cfg, report, seconds)
    os.makedirs(os.path.dirname(os.path.abspath(_TABLE.value)), exist_ok=True)
    with open(_TABLE.value, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(_markdown(row), flush=True)


if __name__ == "__main__":
    cli.run(main)
