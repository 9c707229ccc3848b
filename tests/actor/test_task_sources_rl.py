"""`launch.rl` takes its prompts from any task source chosen by flag: here one run on a weighted
mixture of a JSONL file, a shipped repository task set (toolz, graded by its own pytest suite)
and a source defined in a test module, loaded by import path (the package is not touched).
Every prompt of the epoch is trained once, and they are exactly the ones the source yields for
the run's seed."""

import json
import os
import subprocess
import sys

import pytest

from composer_jax import envs
from composer_jax.actor.ledger import GroupLedger
from tests.helpers import SMALL_RL_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, GROUPS = 3, 2


def _jsonl(path):
    records = [
        {
            "id": f"scale-{k}",
            "prompt": f"Write f(x) in solution.py returning x * {k}.",
            "files": {"solution.py": "def f(x):\n    raise NotImplementedError\n"},
            "grader": {
                "kind": "cases",
                "module": "solution",
                "function": "f",
                "cases": [{"args": [v], "expected": v * k} for v in range(3)],
            },
            "oracle_files": {"solution.py": f"def f(x):\n    return x * {k}\n"},
        }
        for k in range(2, 6)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _mixture(tmp_path) -> str:
    return (
        f"jsonl:{_jsonl(tmp_path / 'tasks.jsonl')}:1,"
        "repositories:toolz:1,"
        "tests.envs.tasks.task_plugin:make_source:count=4:1"
    )


def test_the_mixture_draws_every_part_by_seed(tmp_path):
    """The default tier's twin of the run below: the epoch that run trains, without the run."""
    spec = _mixture(tmp_path)
    want = envs.load_task_source(spec).take(STEPS * GROUPS, "train", seed=1)
    again = envs.load_task_source(spec).take(STEPS * GROUPS, "train", seed=1)
    assert [t.task_id for t in want] == [t.task_id for t in again]
    assert {t.task_id.split("-")[0].split("/")[0] for t in want} == {"scale", "toolz", "plugin"}


@pytest.mark.slow  # a full launch.rl run (about 80 s); the twin above checks its epoch
@pytest.mark.slow_sample  # CI's short RL run
def test_rl_trains_on_a_mixture_of_jsonl_repositories_and_a_plugin(tmp_path):
    spec = _mixture(tmp_path)
    want = envs.load_task_source(spec).take(STEPS * GROUPS, "train", seed=1)  # cfg.seed + 1
    workdir = tmp_path / "run"
    args = [
        sys.executable,
        "-m",
        "launch.rl",
        f"--config.workdir={workdir}",
        f"--config.rl.tasks={spec}",
        "--config.rl.heldout.tasks=builtin:max_ops=1",
        *SMALL_RL_FLAGS,
        f"--config.steps={STEPS}",
        f"--config.rl.rollout.groups_per_step={GROUPS}",
        f"--config.rl.rollout.num_prompts={STEPS * GROUPS}",  # the epoch: the groups are trained in the
        # order they finish, so a longer epoch would train whichever of its prompts came first
        "--config.rl.rollout.max_staleness=8",
    ]
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ledger = GroupLedger(str(workdir / "ledger"))
    trained = sorted(ledger.load(g).prompt_id for g in ledger if ledger.trained_step(g))
    assert trained == sorted(t.task_id for t in want)
    parts = {t.task_id.split("-")[0].split("/")[0] for t in want}
    assert parts == {"scale", "toolz", "plugin"}  # the seed draws from all three parts
