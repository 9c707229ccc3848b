r"""Does RL raise both the mean and best-of-K? pass@1 .. pass@16 on held-out tasks, before RL (the
warm start) and after it, paired by task.

  python experiments/rl_best_of_k.py                 # the main job, 3 seeds
  python experiments/rl_best_of_k.py --sweep=experiments/sweeps/warm_start_rl.py \
      --root=runs/claims/warm_start_rl --group=warm_start_steps=400 [--samples=16 --num_tasks=16]

Runs the sweep (default experiments/sweeps/main_job_seeds.py; finished runs are skipped), then
`python -m launch.evaluate` on each run of the group and on its warm start (`<run>/warm_start`),
`--samples` episodes per task on the run's own held-out tasks (same tasks and sampling seed before
and after; reports kept in `<run>/eval/`, an existing one is reused). pass@k is the unbiased
estimator (a sample passes when it passes every test); best-of-k the expected best reward of k.
Differences are after - before per task, pooled over the group's seeds, mean +- 95% Student-t
interval over (seed, task) pairs. Prints markdown for experiments/RESULTS.md and writes a figure.
"""

import json
import os
import subprocess
import sys

from absl import app, flags

FLAGS = flags.FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict:
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, path) if p))


def ks(samples: int) -> list[int]:
    return [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= samples]


def evaluate(workdir: str, out: str, samples: int, num_tasks: int) -> dict:
    """launch.evaluate's report for `workdir` (run now unless `out` exists)."""
    if not os.path.isfile(out):
        command = [
            sys.executable,
            "-m",
            "launch.evaluate",
            f"--config.workdir={workdir}",
            f"--samples={samples}",
            f"--ks={','.join(str(k) for k in ks(samples))}",
            f"--num_tasks={num_tasks}",
            f"--out={out}",
            "--noprogress",
        ]
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True, env=_env())
    with open(out) as f:
        return json.load(f)


def paired(before: list[dict], after: list[dict], key: str) -> tuple[float, float, float, float]:
    """(mean before, mean after, mean difference, its 95% half-width), pooled over runs' tasks."""
    from composer_jax.eval.passk import mean_interval

    b, a, d = [], [], []
    for rb, ra in zip(before, after):
        if sorted(rb["per_task"]) != sorted(ra["per_task"]):
            raise ValueError("before and after were evaluated on different tasks")
        for task, entry in rb["per_task"].items():
            b.append(entry[key])
            a.append(ra["per_task"][task][key])
            d.append(a[-1] - b[-1])
    mean, half = mean_interval(d)
    return sum(b) / len(b), sum(a) / len(a), mean, half


def main(argv):
    del argv
    root = os.path.abspath(FLAGS.root)
    sweep = [sys.executable, "-m", "launch.sweep", f"--sweep={FLAGS.sweep}", f"--root={root}"]
    subprocess.run([*sweep, "--parallel=2"], check=True, env=_env())
    runs = sorted(
        os.path.join(root, d)
        for d in os.listdir(root)
        if FLAGS.group in d and os.path.isfile(os.path.join(root, d, "config.json"))
    )
    if not runs:
        raise SystemExit(f"no run of {root} has {FLAGS.group!r} in its name")
    tag = f"k{FLAGS.samples}_t{FLAGS.num_tasks}"
    before, after = [], []
    for run in runs:
        os.makedirs(os.path.join(run, "eval"), exist_ok=True)
        args = (FLAGS.samples, FLAGS.num_tasks)
        before.append(
            evaluate(os.path.join(run, "warm_start"), f"{run}/eval/before_{tag}.json", *args)
        )
        after.append(evaluate(run, f"{run}/eval/after_{tag}.json", *args))
    keys = ["mean_reward"] + [f"pass@{k}" for k in ks(FLAGS.samples)]
    keys += [f"best_of_{k}" for k in ks(FLAGS.samples) if k > 1]
    tasks = sum(len(r["per_task"]) for r in before)
    lines = [
        f"{len(runs)} runs ({', '.join(os.path.basename(r) for r in runs)}), "
        f"{tasks} (seed, task) pairs, {FLAGS.samples} samples per task:",
        "",
        "| metric | before RL | after RL | after - before (paired by task) |",
        "| --- | ---: | ---: | ---: |",
    ]
    table = {}
    for key in keys:
        b, a, d, half = paired(before, after, key)
        table[key] = (b, a, d, half)
        lines.append(f"| {key} | {b:.3f} | {a:.3f} | {d:+.3f} +- {half:.3f} |")
    print("\n".join(lines))
    plot(table, ks(FLAGS.samples), FLAGS.out)
    print(f"wrote {FLAGS.out}")


def plot(table: dict, k_values: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for index, label in ((0, "before RL (warm start)"), (1, "after RL")):
        ax.plot(k_values, [table[f"pass@{k}"][index] for k in k_values], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="k", ylabel="pass@k (held-out tasks)", title="pass@k before and after RL")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # flags only when run, so tests can import the functions
    flags.DEFINE_string("root", "runs/claims/main_job", "The sweep's root.")
    flags.DEFINE_string(
        "sweep",
        os.path.join(REPO, "experiments", "sweeps", "main_job_seeds.py"),
        "An RL sweep file.",
    )
    flags.DEFINE_string("group", "", "Only the runs whose name contains this.")
    flags.DEFINE_integer("samples", 16, "Episodes per task (the largest k).")
    flags.DEFINE_integer("num_tasks", 16, "Held-out tasks per run.")
    flags.DEFINE_string("out", "experiments/figures/rl_best_of_k.png", "Figure.")
    app.run(main)
