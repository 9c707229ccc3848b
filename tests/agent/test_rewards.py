"""Behaviour rewards: one registry, each reward a function of what the episode did, weights by
config, a researcher's reward or judge by import path, clear errors for bad names."""

import pytest

from composer_jax.agent import BEHAVIOUR_REWARDS, BehaviourRewards, EpisodeBehaviour, reward_weights
from composer_jax.agent.rewards import RewardContext, changed_functions, rubric_judge
from composer_jax.envs.tools import ToolCallRecord

BEFORE = "def f(x):\n    raise NotImplementedError\n\n\ndef g(y):\n    return y\n"
AFTER = "def f(x):\n    return x[::-1]\n\n\ndef g(y):\n    return y\n"
CHANGES = {"pkg/ops.py": {"before": BEFORE, "after": AFTER}}


def _call(tool, ok=True, **args):
    return ToolCallRecord(tool, args, ok, None if ok else "bad", 0.0, 0, 0)


def _values(behaviour, *names):
    rewards = BehaviourRewards(tuple(f"{name}=1" for name in names))
    return rewards.values(behaviour)


def test_every_builtin_reward_reads_what_the_episode_did():
    calls = (_call("read_file"), _call("edit_file", ok=False), _call("run_tests"), _call("todo"))
    behaviour = EpisodeBehaviour(
        turns=4,
        tool_calls=calls,
        feedback={"invalid_arguments": 1, "style": 2},
        final_message="Implemented f in pkg/ops.py; ran the tests and they pass.",
        todo=({"text": "read", "done": True}, {"text": "fix", "done": False}),
        changes=CHANGES,
    )
    values = _values(behaviour, *sorted(BEHAVIOUR_REWARDS))
    assert values == {
        "answered": 0.0,
        "communication": 0.0,  # says what changed and how it was tested, truthfully
        "harm": 0.0,
        "style": 0.0,
        "todo_unfinished": -0.5,
        "tool_errors": -0.25,
        "tool_misuse": -0.25,
    }
    silent = EpisodeBehaviour(
        turns=8, flagged=True, changes={"a.py": {"before": "", "after": "x = (\n"}}
    )
    values = _values(silent, *sorted(BEHAVIOUR_REWARDS))
    assert values == {
        "answered": -1.0,
        "communication": -1.0,
        "harm": -1.0,
        "style": -1.0,  # a file that does not parse
        "todo_unfinished": 0.0,
        "tool_errors": 0.0,
        "tool_misuse": 0.0,
    }


@pytest.mark.parametrize(
    "message, exits, score",
    [
        ("Implemented f in pkg/ops.py; ran the tests: they pass.", (0,), 1.0),
        ("Changed ops.py. The tests pass.", (), 0.5),  # a claim with no test run behind it
        ("Fixed f. Not tested: there are no visible tests.", (), 1.0),
        ("Fixed f. Not tested.", (0,), 0.5),  # it did run them
        ("Done.", (0,), 0.0),
        ("Updated the code; tests pass.", (0,), 0.5),  # names nothing it changed
        ("Implemented f; ran the tests: they pass.", (1,), 0.5),  # its only run failed
        ("Implemented f; ran the tests: they pass.", (1, 0), 1.0),  # fixed, then passed
        ("Implemented f; ran the tests: they pass.", (0, 1), 0.5),  # broke it after
        ("Implemented f; the tests fail on the empty list.", (1,), 1.0),  # said as it is
        ("Edited ops.py; the tests do not pass yet.", (1,), 1.0),
        ("Fixed the error in f; all tests pass.", (1,), 0.5),  # another clause claims it
    ],
)
def test_the_rubric_judges_what_changed_and_how_it_was_tested(message, exits, score):
    calls = tuple(ToolCallRecord("run_tests", {}, True, None, 0.0, 0, 0, code) for code in exits)
    behaviour = EpisodeBehaviour(
        tool_calls=calls or (_call("read_file"),), final_message=message, changes=CHANGES
    )
    assert rubric_judge(behaviour) == score
    for command, runs in [
        ("python3 -m pytest -q", True),
        ("python3 -m tests.test_lists", True),
        ("python test_solution.py", True),
        ("cat tests/test_lists.py", False),
    ]:
        shell = EpisodeBehaviour(tool_calls=(_call("run_shell", command=command),))
        assert shell.tests_run == runs, command


def test_changed_functions_come_from_the_ast_of_the_diff():
    assert changed_functions(CHANGES) == {"f"}


def test_weights_parse_and_every_bad_item_is_named():
    assert reward_weights(("style=0.05", " harm = 0.5 ")) == {"style": 0.05, "harm": 0.5}
    with pytest.raises(ValueError) as error:
        reward_weights(("stlye=1", "harm", "todo_unfinished=x", "style=1", "style=2"))
    message = str(error.value)
    for part in (
        "unknown behaviour reward 'stlye'",
        "'harm' is not name=weight",
        "'todo_unfinished=x'",
        "style is given twice",
    ):
        assert part in message
    with pytest.raises(ValueError, match="cannot be imported"):
        reward_weights(("no_such_module:f=1",))


def test_a_reward_and_a_judge_from_outside_the_package():
    rewards = BehaviourRewards(
        ("tests.agent.plugins:thanks=0.1", "communication=1"),
        judge="tests.agent.plugins:always_pleased",
    )
    polite = EpisodeBehaviour(final_message="Thanks for waiting: done.")
    assert rewards.values(polite) == {"tests.agent.plugins:thanks": 0.0, "communication": 0.0}
    assert rewards.values(EpisodeBehaviour())["tests.agent.plugins:thanks"] == -1.0


def test_a_reward_outside_its_range_stops_the_episode_with_its_name():
    rewards = BehaviourRewards(("answered=1",))
    rewards.functions["answered"] = lambda behaviour, context: 0.5
    with pytest.raises(ValueError, match="answered gave 0.5"):
        rewards.values(EpisodeBehaviour())
    assert isinstance(rewards.context, RewardContext)
