"""The per-stage breakdown of agent episodes: a scripted episode that stops at each stage is
counted at that stage, through the real workflow, sandbox and grader."""

import dataclasses
import re

import pytest

from composer_jax import agent, envs, presets
from composer_jax.agent import stages
from composer_jax.agent.oracle import plan_change
from composer_jax.config import ModelConfig
from composer_jax.envs.tasks.builtin_repo import STUB
from tests.actor.scripted import BYTES, ScriptedEngine


@pytest.fixture(scope="module")
def task():
    return envs.load_task_source("builtin_repo:max_ops=2").take(1, "held_out", seed=2)[0]


def scripts(task):
    """Turns that stop at each stage (by name), and a complete episode."""
    target = stages.target_of(task)
    test_file = next(text for path, text in task.files.items() if path.startswith("tests/test_"))
    visible_answer = re.search(r"^expected = (.*)$", test_file, re.M).group(1)  # visible only
    read = envs.render_call("read_file", {"path": target.path})

    def edit(new):
        return envs.render_call("edit_file", {"path": target.path, "old": STUB, "new": new})

    final = envs.render_turn(final="Implemented it; the tests pass.")
    good = edit(plan_change(task).new)
    return {
        "found_file": [envs.render_call("read_file", {"path": "helpers/nope.py"}), final],
        "read_function": [
            envs.render_call("search_code", {"query": target.name, "path": target.path}),
            final,
        ],
        "body_parses": [read, edit("    return (\n"), final],
        "visible_test": [read, edit("    return None\n"), final],
        "hidden_tests": [read, edit(f"    return {visible_answer}\n"), final],
        "report": [read, good, envs.render_call("run_tests", {})],  # runs out of turns
        "complete": [read, good, envs.render_call("run_tests", {}), final],
    }


def play(task, turns):
    rl = dataclasses.replace(
        presets.rl_agent_tiny().rl,
        agent=dataclasses.replace(
            presets.rl_agent_tiny().rl.agent, summary_budget=0, max_turns=4, feedback_detectors=()
        ),
        rollout=dataclasses.replace(
            presets.rl_agent_tiny().rl.rollout, context_len=4096, max_new_tokens=2048
        ),
    )
    workflow, environment = agent.build(
        rl.agent,
        BYTES,
        ModelConfig(),
        max_len=rl.rollout.context_len,
        sampling=agent.rollout_sampling(rl.rollout),
        distill=rl.objective.distill_coef > 0,
    )
    engine = ScriptedEngine(lambda prompt, turn: turns[min(turn, len(turns) - 1)], BYTES, 1)
    (outcome,) = agent.play(engine, [(task, "k")], workflow, environment)
    return outcome


def visible(task, files):
    return envs.visible_test_passes(task, files, require_isolation=False)


def test_each_scripted_failure_is_counted_at_its_stage(task):
    played = {name: play(task, turns) for name, turns in scripts(task).items()}
    for name, outcome in played.items():
        assert stages.first_missed(stages.episode_stages(task, outcome, visible)) == name
    assert played["complete"].reward == 1.0 and played["hidden_tests"].reward < 1.0
    breakdown = stages.stage_breakdown([(task, o) for o in played.values()], visible)
    assert breakdown["failed_at"] == dict.fromkeys([*stages.STAGES, stages.COMPLETE], 1)
    assert breakdown["reached"]["found_file"] == 6 and breakdown["unknown"] == 0
    table = stages.format_stages(breakdown)
    assert "visible_test" in table and "1/7 (14%)" in table


def test_an_episode_cut_short_is_judged_by_its_edits_replayed(task):
    turns = scripts(task)["complete"]
    outcome = play(task, turns)
    target = stages.target_of(task)
    cut = dataclasses.replace(
        outcome, trace=dataclasses.replace(outcome.trace, changes={}, final_message=None)
    )
    assert stages.final_text(task, cut, target.path) == outcome.trace.changes[target.path]["after"]
    got = stages.episode_stages(task, cut, visible)
    assert got["visible_test"] and not got["report"]


def test_an_open_tab_that_shows_the_function_counts_as_reading_it(task):
    outcome = play(task, scripts(task)["read_function"])  # searched, never read
    assert not stages.episode_stages(task, outcome, visible)["read_function"]
    assert stages.episode_stages(task, outcome, visible, open_tab_lines=40)["read_function"]
    assert not stages.episode_stages(task, outcome, visible, open_tab_lines=2)["read_function"]


def test_a_task_without_a_target_function_is_unknown():
    task = envs.load_task_source("state_tracking").take(1, "test", seed=0)[0]
    outcome = agent.EpisodeOutcome(sequences=[], reward=0.0)
    assert stages.target_of(task) is None
    breakdown = stages.stage_breakdown([(task, outcome)], visible)
    assert breakdown["unknown"] == 1 and "no episode" in stages.format_stages(breakdown)
