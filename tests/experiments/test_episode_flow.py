"""experiments/episode_flow.py on hand-made turns: a one-attempt sample (the failing test asks for
a summary, the restart never edits) and a sample that fixes its body after a failing test; and
the turns of a chain decoded from its policy mask."""

import numpy as np

from composer_jax import envs
from composer_jax.envs.environment import CUT_OFF_CALL
from composer_jax.rl import SegmentKind, Sequence
from experiments import episode_flow
from experiments.episode_flow import Turn

EDIT = envs.render_call("edit_file", {"path": "a.py", "old": "x", "new": "y"})
TESTS = envs.render_call("run_tests", {})
EDITED = '\n<output tool="edit_file">edited a.py</output>\n'
FAILED = '\n<output tool="run_tests">\nAssertionError\n[exit code 1]\n</output>\n'
PASSED = '\n<output tool="run_tests">\nok\n[exit code 0]\n</output>\n'
ASKED = "\n[context budget reached: summarise ...]\n<summary>"
NOT_ONCE = "error: `old` must occur exactly once in a.py, found 0"


def test_a_one_attempt_sample_and_a_repaired_one_are_told_apart():
    one_attempt = [
        Turn(0, EDIT, EDITED),
        Turn(0, TESTS, FAILED + ASKED),
        Turn(0, "a summary</summary>", ""),
        Turn(1, EDIT, f'\n<output tool="edit_file">{NOT_ONCE}</output>\n'),
        Turn(1, "<final>done</final>", ""),
    ]
    counts = episode_flow.sample_flow(one_attempt, 0.0)
    assert counts["failing_test"] == counts["summary_at_failure"] == 1
    assert counts["edits_tried_after_restart"] == 1 and not counts["edits_applied_after_restart"]
    assert counts["restart_edit_old_not_once"] == 1 and not counts["restart_edit_cut_off"]
    missing = f'\n<output tool="edit_file">error: edit_file: missing argument {"new"!r}</output>\n'
    cut = f'\n<output tool="edit_file">{CUT_OFF_CALL}</output>\n'
    failed = episode_flow.sample_flow([Turn(1, EDIT, missing), Turn(1, EDIT, cut)], 0.0)
    assert failed["restart_edit_missing_argument"] == failed["restart_edit_cut_off"] == 1
    assert not counts["edit_after_failure"] and not counts["two_applied_edits"]
    repaired = [
        Turn(0, EDIT, EDITED),
        Turn(0, TESTS, FAILED),
        Turn(0, EDIT, EDITED),
        Turn(0, TESTS, PASSED),
        Turn(0, "<final>done</final>", ""),
    ]
    counts = episode_flow.sample_flow(repaired, 1.0)
    assert counts["edit_after_failure"] == counts["reward_1_after_failure"] == 1
    assert counts["two_applied_edits"] == 1 and not counts["summary_at_failure"]
    assert not counts["first_test_passed"]
    passed = episode_flow.sample_flow([Turn(0, TESTS, PASSED)], 1.0)
    assert passed["first_test_passed"] == passed["reward_1_first_test_passed"] == 1
    assert not passed["failing_test"]


def test_a_fix_stated_in_the_summary_is_told_from_the_edit_that_follows():
    """The summary at the failing test states the fix; the restarted edit writes it or not."""
    fix = "    x = x.upper()\n    return x"
    summary = f"f (a.py)\nDone: ran the tests: they fail. Next: fix f.\nThe fix writes:\n{fix}\n"
    planned = envs.render_call("edit_file", {"path": "a.py", "old": "    return x", "new": fix})
    turns = [
        Turn(0, TESTS, FAILED + ASKED),
        Turn(0, summary + "The tests failed: AssertionError</summary>", ""),
        Turn(1, EDIT, f'\n<output tool="edit_file">{NOT_ONCE}</output>\n'),
        Turn(1, planned, EDITED),
        Turn(1, TESTS, PASSED + ASKED),
        Turn(1, "f (a.py)\nDone: fixed f. Next: report.</summary>", ""),
        Turn(2, planned, EDITED),  # its summary stated no fix
    ]
    counts = episode_flow.sample_flow(turns, 1.0, function="f")
    assert counts["fix_planned_at_failure"] == counts["summary_names_function"] == 1
    assert not episode_flow.sample_flow(turns, 1.0, function="g")["summary_names_function"]
    assert counts["restart_edits_as_planned"] == 1
    assert counts["edits_tried_after_restart"] == 3
    cut = [Turn(0, TESTS, FAILED + ASKED), Turn(0, summary + "The tests", ""), Turn(1, planned, "")]
    counts = episode_flow.sample_flow(cut, 0.0)
    assert counts["fix_planned_at_failure"] == counts["restart_edits_as_planned"] == 1
    unplanned = [Turn(0, TESTS, FAILED + ASKED), Turn(0, "f (a.py)\nNext: fix f.</summary>", "")]
    assert not episode_flow.sample_flow(unplanned, 0.0)["fix_planned_at_failure"]
    # A fix with a blank line, stated last in its summary; two edits in one turn count once.
    fix = "    x = x.upper()\n\n    return x"
    planned = envs.render_call("edit_file", {"path": "a.py", "old": "    return x", "new": fix})
    last = [
        Turn(0, TESTS, FAILED + ASKED),
        Turn(0, f"f (a.py)\nNext: fix f.\nThe fix writes:\n{fix}</summary>", ""),
        Turn(1, planned + "\n" + planned, EDITED),
    ]
    counts = episode_flow.sample_flow(last, 0.0)
    assert counts["restart_edits_as_planned"] == counts["edits_tried_after_restart"] == 1


def test_a_chains_turns_come_from_its_policy_runs():
    tokens = np.arange(10, dtype=np.int32)
    policy = np.array([0, 0, 1, 1, 0, 0, 1, 0, 0, 0], bool)
    seq = Sequence(
        sample_index=0,
        tokens=tokens,
        kinds=np.full(10, SegmentKind.PROMPT, np.int32),
        policy_mask=policy,
        sampler_logprobs=np.zeros(10, np.float32),
        policy_versions=np.zeros(10, np.int32),
    )
    decode = lambda ids: ",".join(str(i) for i in ids)  # noqa: E731
    turns = episode_flow.chain_turns([seq, seq], decode)
    assert turns[:2] == [Turn(0, "2,3", "4,5"), Turn(0, "6", "7,8,9")]
    assert [t.generation for t in turns] == [0, 0, 1, 1]
