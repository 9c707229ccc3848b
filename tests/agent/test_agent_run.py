"""The agent's plug-in points from the command line: a workflow and a behaviour reward from a
test module drive a run without touching the package; a bad name is a one-line error at start-up
that names its field, before anything is written."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.samples import group_sequences
from composer_jax.agent import check_agent_config
from composer_jax.config import AgentConfig, ConfigError
from composer_jax.data import ByteTokenizer
from composer_jax.train.metrics import read_metrics
from tests.agent.plugins import PLAN_NOTE
from tests.helpers import SMALL_RL_FLAGS
from tests.test_cli import launch, one_line_error

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "field, value, needles",
    [
        ("workflow", "no_such_module:make", ["cannot be imported"]),
        ("workflow", "loop", ["unknown workflow 'loop'"]),
        ("behaviour_rewards", ("stlye=0.1",), ["'stlye'"]),
        ("communication_judge", "gpt", ["'gpt'"]),
        ("tools", "read_file,shel", ["unknown tool 'shel'"]),
        ("eval_tools", "agent,todo", ["unknown tool 'agent'"]),
        ("feedback_detectors", ("style", "rude"), ["'rude'"]),
    ],
)
def test_every_plug_in_name_is_checked_before_the_run(field, value, needles):
    with pytest.raises(ConfigError) as error:
        check_agent_config(dataclasses.replace(AgentConfig(), **{field: value}))
    assert str(error.value).startswith(f"rl.agent.{field}: ")
    assert all(needle in str(error.value) for needle in needles)
    assert "\n" not in str(error.value)


def test_a_bad_plug_in_name_stops_launch_rl_with_one_line_and_no_workdir(tmp_path):
    workdir = tmp_path / "run"
    override = "--config.rl.agent.behaviour_rewards=style=0.05,stlye=0.1"
    result = launch("rl", f"--config.workdir={workdir}", override, cwd=tmp_path)
    one_line_error(result, "rl.agent.behaviour_rewards", "unknown behaviour reward 'stlye'")
    assert not workdir.exists()


def test_a_workflow_and_a_reward_from_a_test_module_drive_a_run(tmp_path):
    workdir = tmp_path / "run"
    steps = 2
    args = [
        sys.executable,
        "-m",
        "launch.rl",
        f"--config.workdir={workdir}",
        "--config.rl.agent.workflow=tests.agent.plugins:plan_first",
        "--config.rl.agent.behaviour_rewards=tests.agent.plugins:thanks=0.1,answered=0.05",
        *SMALL_RL_FLAGS,
        f"--config.steps={steps}",
        "--config.rl.rollout.groups_per_step=1",
    ]
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps_logged = [m for m in read_metrics(str(workdir / "metrics.jsonl")) if "reward_mean" in m]
    assert len(steps_logged) == steps
    # The reward is computed, kept in the ledger and weighted into the objective's metrics.
    assert all("reward/tests.agent.plugins:thanks" in m for m in steps_logged)
    ledger = GroupLedger(str(workdir / "ledger"))
    group = ledger.load(next(iter(ledger)))
    np.testing.assert_array_equal(group.arrays["behaviour"]["tests.agent.plugins:thanks"], [-1, -1])
    # The plug-in workflow played the episodes.
    for seq in group_sequences(group):
        assert ByteTokenizer().decode(seq.tokens).startswith(PLAN_NOTE)
    config = json.loads((workdir / "config.json").read_text())
    assert config["rl"]["agent"]["workflow"] == "tests.agent.plugins:plan_first"
