r"""Environment throughput and grading cost, plus an example pass@k report.

Runs `--episodes` built-in episodes at once through `EpisodePool` (half scripted oracle, half
random policy, several samples per task), prints episodes/s and the evaluation table, the cost of
one sandboxed command and of one grading per sandbox backend usable here (median wall and the
machine's mean busy CPU, so run it on an idle machine; against the unisolated fallback in the
same run), and gradings/s of repository tasks next to HumanEval and built-in tasks.

  python experiments/bench_envs.py [--episodes=64] [--workers=16] [--report=envs_report.json]
"""

import dataclasses
import os
import random
import statistics
import time

from absl import app, flags

from composer_jax.envs import (
    EnvConfig,
    EpisodePool,
    Sandbox,
    builtin_tasks,
    bwrap_available,
    grade,
    oracle_turns,
    random_turns,
)
from composer_jax.envs.sandbox import isolation
from composer_jax.envs.tasks.humaneval import humaneval_tasks
from composer_jax.envs.tasks.repo_task_sets import read_task_set, shipped_sets
from composer_jax.eval.passk import EpisodeRecord, evaluate, format_table, write_report

_EPISODES = flags.DEFINE_integer("episodes", 64, "Concurrent episodes.")
_WORKERS = flags.DEFINE_integer("workers", 16, "Threads stepping episodes.")
_SAMPLES = flags.DEFINE_integer("samples", 4, "Samples per task (for pass@k).")
_REPORT = flags.DEFINE_string("report", "", "If set, write the evaluation report JSON here.")
_COMMANDS = flags.DEFINE_integer(
    "commands", 20, "Commands and gradings timed per backend (0: skip)."
)


def _machine_cpu_seconds() -> float:
    """Busy CPU time of the whole machine so far (/proc/stat). A sandboxed command's processes
    are not all waited for by this one (bwrap's own init reaps them), so child rusage misses
    them; the machine's counters do not, at the price of counting anything else that runs."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _timed(fn, repeats: int) -> tuple[float, float]:
    """(median wall seconds, mean busy CPU seconds of the machine) of `fn()`: where decoding,
    training and grading share a few cores, the CPU a grading burns is its cost."""
    walls = []
    cpu_start = _machine_cpu_seconds()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    return statistics.median(walls), (_machine_cpu_seconds() - cpu_start) / repeats


def backend_costs(repeats: int) -> None:
    """Wall (median) and CPU (mean) of `true` and of grading an oracle solution, per usable
    backend."""
    task = builtin_tasks(1, split="held_out")[0]
    rows = []
    for backend in ("rlimit", "unshare", "bwrap"):
        if not isolation.usable(backend):
            rows.append((backend, None, None))
            continue
        with Sandbox.from_files(task.files, backend=backend, require_isolation=False) as box:
            command = _timed(lambda: box.run("true"), repeats)
            box.restore({**task.files, **task.oracle_files})

            def grade_oracle():
                assert grade(box, task).reward == 1.0

            grading = _timed(grade_oracle, repeats)
        rows.append((backend, command, grading))
    base = rows[0][1][0]
    print("backend   command ms  vs rlimit  command CPU ms  grading ms  grading CPU ms")
    for backend, command, grading in rows:
        if command is None:
            print(f"{backend:8}  n/a: not usable here")
            continue
        print(
            f"{backend:8}  {command[0] * 1e3:10.1f}  {command[0] / base:8.2f}x  "
            f"{command[1] * 1e3:14.1f}  {grading[0] * 1e3:10.1f}  {grading[1] * 1e3:14.1f}"
        )


def grading_rates(repeats: int) -> None:
    """Gradings per second of a repository task (its own pytest suite, guarded runner; with and
    without the replay of its recorded calls that rewards it) next to
    HumanEval's `check` grader and a built-in `cases` grader, per isolating backend: the oracle
    solution graded `repeats` times in one sandbox (the worker's slot warmed first)."""
    kinds = {
        "builtin (cases)": builtin_tasks(1, split="held_out")[0],
        "humaneval (check)": humaneval_tasks("test")[0],
    }
    for name in ("toolz", "more_itertools"):
        task = min(read_task_set(shipped_sets()[name]), key=lambda t: len(t.graded_tests))
        suite_only = {k: v for k, v in task.grader.items() if k != "replay"}
        kinds[f"{name} (pytest)"] = dataclasses.replace(task, grader=suite_only)
        kinds[f"{name} (pytest+replay)"] = task
    print("task                             backend   grading ms  grading CPU ms  gradings/s")
    for backend in ("unshare", "bwrap"):
        if not isolation.usable(backend):
            print(f"{'':31}  {backend:8}  n/a: not usable here")
            continue
        for kind, task in kinds.items():
            with Sandbox.from_files(
                {**task.files, **task.oracle_files}, backend=backend, require_isolation=False
            ) as box:

                def grade_oracle():
                    assert grade(box, task).reward == 1.0, task.task_id

                grade_oracle()  # the first grading of a repository warms the slot's bytecode
                wall, cpu = _timed(grade_oracle, repeats)
            print(
                f"{kind:31}  {backend:8}  {wall * 1e3:10.1f}  {cpu * 1e3:14.1f}  {1 / wall:10.2f}"
            )


def run_concurrent(num_episodes: int, workers: int, samples: int) -> list[EpisodeRecord]:
    tasks = builtin_tasks(max(1, num_episodes // samples), split="held_out")
    rng = random.Random(0)
    jobs = []
    for index in range(num_episodes):
        task = tasks[index % len(tasks)]
        script = oracle_turns(task) if rng.random() < 0.5 else random_turns(task, rng)
        jobs.append((task, script))
    start = time.monotonic()
    with EpisodePool(max_workers=workers) as pool:
        episodes = [f.result() for f in [pool.start(task, EnvConfig()) for task, _ in jobs]]
        results = [None] * len(jobs)
        active = list(range(len(jobs)))
        for turn in range(max(len(script) for _, script in jobs)):
            active = [i for i in active if turn < len(jobs[i][1])]
            futures = {i: pool.submit(episodes[i], jobs[i][1][turn]) for i in active}
            for i, future in futures.items():
                results[i] = future.result()
            active = [i for i in active if not results[i].done]
    elapsed = time.monotonic() - start
    for episode in episodes:
        episode.close()
    print(
        f"{num_episodes} concurrent episodes ({workers} threads): {elapsed:.2f}s, "
        f"{num_episodes / elapsed:.1f} episodes/s, bwrap={bwrap_available()}"
    )
    records = []
    for (task, _), result in zip(jobs, results):
        counts = result.counts
        tokens = sum(v for k, v in counts.items() if k.endswith("_tokens"))
        records.append(
            EpisodeRecord(
                task.task_id,
                result.reward,
                tokens,
                counts["tool_calls"],
                bool(result.flags),
                turns=counts["turns"],
            )
        )
    return records


def main(argv):
    del argv
    if _COMMANDS.value:
        backend_costs(_COMMANDS.value)
        grading_rates(_COMMANDS.value)
    records = run_concurrent(_EPISODES.value, _WORKERS.value, _SAMPLES.value)
    report = evaluate(records, ks=(1, 2, _SAMPLES.value))
    print(format_table(report))
    if _REPORT.value:
        write_report(report, _REPORT.value)


if __name__ == "__main__":
    app.run(main)
