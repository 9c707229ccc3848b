"""`launch.evaluate`: a run on a task source, K episodes per task through the real environments,
a report with pass@k, intervals, per-task entries, groups and timings."""

import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from composer_jax import envs
from composer_jax.actor.setup import rl_prompt_tasks
from composer_jax.config import ModelConfig, RLConfig
from composer_jax.data import ByteTokenizer
from composer_jax.envs.grading.protocol import render_turn
from composer_jax.eval import tasks as eval_tasks
from composer_jax.eval.tasks import TaskEvalConfig, evaluate_tasks
from composer_jax.model import init_model
from composer_jax.train import run_pretraining
from composer_jax.train.workdir import read_run_config, write_config
from tests.actor.scripted import BYTES, ScriptedEngine
from tests.train.helpers import ONE_PHASE, make_corpus, small_model_config, tiny_experiment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_evaluate_tasks_plays_every_sample_and_groups_by_metadata():
    model = init_model(small_model_config(), seed=0)
    tasks = envs.load_task_source("state_tracking:per_length=1:lengths=1-2:window=4").take(
        2, "test"
    )
    cfg = TaskEvalConfig(
        samples=2,
        ks=(1, 2),
        max_turns=1,
        max_new_tokens=8,
        context_len=512,
        num_slots=4,
        env_workers=2,
    )
    report = evaluate_tasks(model, ByteTokenizer(), tasks, cfg, progress=False)
    assert report["summary"]["episodes"] == 4 and report["summary"]["tasks"] == 2
    assert set(report["by_group"]) == {"history_length=1", "history_length=2"}
    assert all(entry["samples"] == 2 for entry in report["per_task"].values())
    assert report["summary"]["mean_tokens"] > 0
    assert report["timing"]["total_seconds"] >= report["timing"]["environment_seconds"] >= 0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    corpus = make_corpus(str(root / "corpus"))
    cfg = tiny_experiment(str(root / "run"), corpus, steps=2, phases=ONE_PHASE)
    run_pretraining(cfg, progress=False)
    return str(root / "run")


def test_launch_evaluate_writes_the_report_and_prints_the_table(run_dir, tmp_path):
    out = tmp_path / "report.json"
    args = [
        sys.executable,
        "-m",
        "launch.evaluate",
        f"--config.workdir={run_dir}",
        "--tasks=tests.envs.tasks.task_plugin:make_source:count=3",
        "--samples=2",
        "--ks=1,2",
        "--max_turns=1",
        "--max_new_tokens=8",
        "--context_len=512",
        "--num_slots=4",
        f"--out={out}",
        "--noprogress",
    ]
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert sorted(report["per_task"]) == ["plugin-0", "plugin-1", "plugin-2"]
    for key in ("pass@1", "pass@1_ci95", "pass@2", "best_of_2", "mean_tool_calls", "mean_turns"):
        assert key in report["summary"], key
    assert report["setup"]["samples"] == 2 and report["setup"]["split"] == "train"
    assert "pass@2" in done.stdout and "in the environments" in done.stdout
    stages = report["stages"]  # an untrained model: most stop at the first stage
    assert stages["episodes"] == 6 and sum(stages["failed_at"].values()) == 6 - stages["unknown"]
    assert "Where the episodes stopped" in done.stdout


def test_launch_evaluate_runs_on_a_shipped_repository_set(run_dir, tmp_path):
    out = tmp_path / "report.json"
    args = [sys.executable, "-m", "launch.evaluate", f"--config.workdir={run_dir}"]
    args += ["--tasks=repositories:toolz", "--split=held_out", "--num_tasks=2", "--samples=1"]
    args += ["--ks=1", "--max_turns=1", "--max_new_tokens=8", "--context_len=1024"]
    args += ["--num_slots=2", f"--out={out}", "--noprogress"]
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["per_task"]) == 2
    assert all(task.startswith("toolz/") for task in report["per_task"])
    assert report["stages"]["unknown"] == 0  # the deleted function is each task's target
    assert report["setup"]["split"] == "held_out"


def test_launch_evaluate_takes_the_prompts_an_rl_run_trained_on(run_dir, tmp_path):
    """--trained_by=RUN: the first --num_tasks prompts of RUN's RL epoch (its seed + 1), in
    order; refused beside --tasks with a one-line error."""
    trainer = dataclasses.replace(
        read_run_config(run_dir),
        seed=3,
        workdir=str(tmp_path / "rl"),
        rl=dataclasses.replace(
            RLConfig(),
            tasks="tests.envs.tasks.task_plugin:make_source:count=9",
            rollout=dataclasses.replace(RLConfig().rollout, num_prompts=5),
        ),
    )
    os.makedirs(trainer.workdir)
    write_config(trainer.workdir, trainer)
    prompts = [task.task_id for task in rl_prompt_tasks(trainer)]
    assert len(prompts) == 5
    out = tmp_path / "report.json"
    args = [sys.executable, "-m", "launch.evaluate", f"--config.workdir={run_dir}"]
    args += [f"--trained_by={trainer.workdir}", "--num_tasks=3", "--samples=1", "--ks=1"]
    args += ["--max_turns=1", "--max_new_tokens=4", "--context_len=512", "--num_slots=2"]
    args += [f"--out={out}", "--noprogress"]
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="")
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert sorted(report["per_task"]) == sorted(prompts[:3])
    assert report["setup"]["split"] == "train"
    both = subprocess.run(
        [*args, "--tasks=builtin"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert both.returncode == 2 and "--trained_by: give it alone" in both.stderr


def test_pass_at_k_counts_the_episodes_that_solve(monkeypatch):
    """A scripted policy behind the engine solves exactly one of each task's two episodes (the
    first to start writes the original, the second a wrong body): the report's pass@1 is 0.5,
    pass@2 and best-of-2 are 1, per task and overall, read through the real environments."""
    tasks = [envs.make_task(i) for i in (11, 12)]
    started = {}

    def script(prompt, turn):
        task = next(t for t in tasks if t.prompt in prompt)
        if turn == 0:
            started[task.task_id] = started.get(task.task_id, 0) + 1
            first = started[task.task_id] == 1
            body = task.oracle_files["solution.py"] if first else "def f(x):\n    return None\n"
            return render_turn(calls=(("write_file", {"path": "solution.py", "content": body}),))
        return render_turn(final="done")

    monkeypatch.setattr(
        eval_tasks,
        "InferenceEngine",
        lambda model, num_slots, **_: ScriptedEngine(script, BYTES, num_slots),
    )
    cfg = TaskEvalConfig(samples=2, ks=(1, 2), max_turns=2, max_new_tokens=512, context_len=2048)
    report = evaluate_tasks(SimpleNamespace(cfg=ModelConfig()), BYTES, tasks, cfg, progress=False)
    assert started == {t.task_id: 2 for t in tasks}
    summary = report["summary"]
    assert summary["episodes"] == 4
    assert summary["pass@1"] == pytest.approx(0.5) and summary["pass@2"] == pytest.approx(1.0)
    assert summary["best_of_2"] == pytest.approx(1.0)
    for entry in report["per_task"].values():
        assert entry["samples"] == 2 and entry["pass@1"] == pytest.approx(0.5)
