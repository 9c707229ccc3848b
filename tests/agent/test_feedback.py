"""Text-feedback detectors on real episodes, and the hinted teacher sequence they lead to."""

import numpy as np
import pytest

from composer_jax.agent.feedback import (
    DETECTORS,
    IgnoredToolError,
    InvalidArguments,
    StyleRule,
    ToolUnavailable,
    UnknownTool,
    check_turn,
    make_detectors,
    record_step,
    render_hint,
)
from composer_jax.agent.generation import hinted_turns, teacher_sequence
from composer_jax.data import ByteTokenizer
from composer_jax.envs import EnvConfig, Episode, builtin_tasks, render_call, render_turn
from composer_jax.envs.tools import tool_profile
from composer_jax.rl import SegmentKind, Sequence, pack_trajectories

ROCKETS = render_call("launch_rockets", {"count": "3"})
READ = render_call("read_file", {"path": "solution.py"})
WRITE_NO_CONTENT = render_call("write_file", {"path": "solution.py"})
MISSING_FILE = render_call("read_file", {"path": "nowhere.py"})
FINAL = render_turn(final="Done.")


def _write(content: str, path: str = "solution.py") -> str:
    return render_call("write_file", {"path": path, "content": content})


@pytest.fixture(scope="module")
def task():
    return builtin_tasks(2, seed=11)[1]


def _play(task, *texts, config=EnvConfig()):
    """Plays the turns on a fresh episode; returns their records and the episode's prompt."""
    with Episode(task, config) as episode:
        records = [record_step(episode, i, text)[1] for i, text in enumerate(texts)]
        return records, episode.prompt


def test_unknown_tool(task):
    (bad, good), _ = _play(task, ROCKETS, READ)
    assert not bad.calls[0].ok and good.calls[0].ok
    hint = UnknownTool().check(bad, None)
    assert "launch_rockets" in hint
    for name in bad.available_tools:  # every tool with its parameters
        assert name in hint
    assert "write_file(path, content)" in hint and "read_file(path, start?, end?)" in hint
    assert UnknownTool().check(good, bad) is None


def test_a_tool_the_profile_leaves_out_is_unavailable_not_unknown(task):
    """The episode offers the profile without a shell: run_shell answers "tool not available",
    which ToolUnavailable targets with the tools that are offered; UnknownTool stays quiet."""
    shell = render_call("run_shell", {"command": "ls"})
    config = EnvConfig(tools=tool_profile("agent_no_shell"))
    (turn, rockets), _ = _play(task, shell, ROCKETS, config=config)
    assert not turn.calls[0].ok and turn.calls[0].error.startswith("tool not available: run_shell")
    hint = ToolUnavailable().check(turn, None)
    assert "run_shell is not available" in hint and "todo(action, text?, id?)" in hint
    assert "run_shell(" not in hint
    assert UnknownTool().check(turn, None) is None
    assert ToolUnavailable().check(rockets, turn) is None and UnknownTool().check(rockets, turn)


def test_invalid_arguments(task):
    extra = render_call("read_file", {"path": "solution.py", "line": "3"})
    not_int = render_call("read_file", {"path": "solution.py", "start": "one"})
    records, _ = _play(task, WRITE_NO_CONTENT, extra, not_int, _write("x = 1\n"), MISSING_FILE)
    missing, unknown, malformed, good, tool_failure = records
    detector = InvalidArguments()
    assert "'content'" in detector.check(missing, None)
    assert "new content" in detector.check(missing, None)  # the parameter's description
    assert "'line'" in detector.check(unknown, None)
    assert "'start'" in detector.check(malformed, None)
    assert detector.check(good, None) is None
    assert not tool_failure.calls[0].ok  # the tool failed, its arguments were fine
    assert detector.check(tool_failure, None) is None
    (rockets,) = _play(task, ROCKETS)[0]
    assert detector.check(rockets, None) is None  # unknown tools are another detector's
    (lenient,) = _play(task, extra, config=EnvConfig(strict_tools=False))[0]
    assert lenient.calls[0].ok and detector.check(lenient, None) is None  # the env accepted it


@pytest.mark.parametrize(
    "previous, turn, fires",
    [
        (WRITE_NO_CONTENT, WRITE_NO_CONTENT, True),  # identical repeat
        (WRITE_NO_CONTENT, render_call("run_tests", {}), True),  # moves on to something else
        (WRITE_NO_CONTENT, READ, False),  # reads the involved file
        (WRITE_NO_CONTENT, _write("x = 1\n"), False),  # fixes the call
        (MISSING_FILE, render_call("list_dir", {}), False),  # looks at the file's directory
        (MISSING_FILE, READ, False),  # the same tool on another file
        (MISSING_FILE, render_call("run_shell", {"command": "ls"}), True),  # names no file
        (ROCKETS, ROCKETS + READ, False),  # switched to a real tool (and still tried the bad one)
        (ROCKETS, ROCKETS, True),
        (READ, READ, False),  # nothing failed
    ],
)
def test_ignored_tool_error(task, previous, turn, fires):
    (before, after), _ = _play(task, previous, turn)
    hint = IgnoredToolError().check(after, before)
    assert (hint is not None) == fires
    if fires:
        assert before.calls[0].error in hint
    assert IgnoredToolError().check(before, None) is None


def test_ignored_tool_error_on_final_message(task):
    (before, after), _ = _play(task, WRITE_NO_CONTENT, FINAL)
    assert not after.calls
    assert "write_file" in IgnoredToolError().check(after, before)


def test_style(task):
    solution = task.oracle_files["solution.py"]
    tabbed = solution.replace("    ", "\t")
    long_line = solution + f"y = {'1 + ' * 40}1\n"
    edit = render_call("edit_file", {"path": "solution.py", "old": "def f", "new": "def\tf"})
    edit_tab = render_call("edit_file", {"path": "solution.py", "old": "x", "new": "\tx"})
    texts = [_write(tabbed), _write(long_line), edit_tab, _write(solution), edit]
    texts.append(_write("all:\n\techo hi\n", path="Makefile"))
    records, _ = _play(task, *texts)
    hints = [StyleRule().check(record, None) for record in records]
    assert "line 2" in hints[0] and "tab" in hints[0]
    assert f"line {len(solution.splitlines()) + 1}" in hints[1] and "165" in hints[1]
    assert "tab" in hints[2]
    assert hints[3:] == [None, None, None]  # a tab inside a line and a Makefile's tabs are fine


def test_registry_and_check_turn(task):
    detectors = make_detectors(("style", "unknown_tool", "invalid_arguments"))
    assert [d.name for d in detectors] == ["style", "unknown_tool", "invalid_arguments"]
    assert set(DETECTORS) == {
        "unknown_tool",
        "tool_unavailable",
        "invalid_arguments",
        "ignored_tool_error",
        "style",
    }
    (turn,) = _play(task, ROCKETS + _write("def f(x):\n\treturn x\n"))[0]
    hints = check_turn(detectors, turn, None)
    assert [name for name, _ in hints] == ["style", "unknown_tool"]
    text = render_hint(hints)
    assert text.startswith("[feedback] ") and text.endswith("\n")
    assert all(hint in text for _, hint in hints) and text.count("\n") == 2
    with pytest.raises(ValueError, match="unknown_tool"):
        make_detectors(("style", "no_such_detector"))


def test_a_detector_outside_the_package_is_named_by_its_import_path(task):
    """The recipe WORKSPACE.md gives: a class with `name` and `check`, chosen by config."""
    (style, long_turn) = make_detectors(("style", "tests.agent.plugins:LongTurn"))
    (turn,) = _play(task, READ + " " * 1000)[0]
    assert check_turn([style, long_turn], turn, None) == [
        ("long_turn", f"Keep a turn short: this one has {len(turn.text)} characters.")
    ]
    (turn,) = _play(task, READ)[0]
    assert check_turn([style, long_turn], turn, None) == []


def _random_flagged(rng, length):
    """Sorted, non-overlapping spans (some adjacent, maybe touching both ends) with hints."""
    cuts = np.sort(rng.choice(np.arange(length + 1), size=8, replace=False))
    cuts[0], cuts[-1] = rng.choice([0, cuts[0]]), rng.choice([length, cuts[-1]])
    return [
        (int(a), int(b), rng.integers(300, 400, size=rng.integers(1, 7)))
        for a, b in zip(cuts[:-1], cuts[1:])
        if rng.random() < 0.6
    ]


@pytest.mark.parametrize("seed", range(6))
def test_teacher_sequence_round_trip(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 259, size=int(rng.integers(20, 200))).astype(np.int32)
    original = tokens.copy()
    flagged = _random_flagged(rng, len(tokens))
    teacher, target = teacher_sequence(tokens, flagged)
    assert teacher.dtype == np.int32 and target.dtype == np.int32
    assert len(teacher) == len(tokens) + sum(len(h) for _, _, h in flagged)
    assert target.shape == tokens.shape
    np.testing.assert_array_equal(tokens, original)  # the student is untouched
    on_span = np.zeros(len(tokens), bool)
    for start, end, hint in flagged:
        on_span[start:end] = True
        first = target[start]
        np.testing.assert_array_equal(teacher[first - len(hint) : first], hint)
    np.testing.assert_array_equal(target >= 0, on_span)
    np.testing.assert_array_equal(teacher[target[on_span]], tokens[on_span])
    # Dropping the hint tokens (all >= 300) gives the student tokens back.
    np.testing.assert_array_equal(teacher[teacher < 300], tokens)
    # And the spans are read back from the teacher (what SFT and experiments see in a ledger).
    found = hinted_turns(tokens, teacher, target)
    assert [(s, e) for s, e, _ in found] == [(s, e) for s, e, _ in flagged]
    for (_, _, hint), (_, _, expected) in zip(found, flagged):
        np.testing.assert_array_equal(hint, expected)


def test_hinted_turns_refuse_a_teacher_that_is_not_the_hinted_sequence():
    tokens = np.arange(40, dtype=np.int32)
    teacher, target = teacher_sequence(tokens, [(10, 15, np.array([97, 98], np.int32))])
    teacher[0] += 1
    with pytest.raises(ValueError, match="not the sequence with hints"):
        hinted_turns(tokens, teacher, target)


def test_teacher_sequence_rejects_bad_spans():
    tokens = np.arange(10)
    hint = np.array([1, 2])
    for flagged in ([(4, 8, hint), (6, 9, hint)], [(5, 9, hint), (1, 3, hint)], [(3, 3, hint)]):
        with pytest.raises(ValueError, match="flagged span"):
            teacher_sequence(tokens, flagged)
    assert len(teacher_sequence(tokens, [])[0]) == 10


def test_packed_teacher_points_at_the_flagged_turn(task):
    """Episode -> detection -> hinted teacher -> packer: the index hits the same tokens."""
    tok = ByteTokenizer()
    turns = [READ, ROCKETS, _write(task.oracle_files["solution.py"])]
    records, prompt = _play(task, *turns)
    detectors = make_detectors(tuple(DETECTORS))
    tokens, kinds, spans, flagged = list(tok.encode(prompt)), [], [], []
    kinds = [SegmentKind.PROMPT] * len(tokens)
    for previous, record in zip([None, *records], records):
        start = len(tokens)
        tokens += list(tok.encode(record.text))
        kinds += [SegmentKind.THINKING] * (len(tokens) - start)
        spans.append((start, len(tokens)))
        hints = check_turn(detectors, record, previous)
        if hints:
            flagged.append((start, len(tokens), tok.encode(render_hint(hints))))
        appended = tok.encode(f"\n{record.observation}\n")
        tokens += list(appended)
        kinds += [SegmentKind.TOOL_OUTPUT] * len(appended)
    assert [f[:2] for f in flagged] == [spans[1]]  # only the rockets turn is flagged
    tokens, kinds = np.asarray(tokens, np.int32), np.asarray(kinds, np.int32)
    teacher, target = teacher_sequence(tokens, flagged)
    assert "[feedback] There is no tool 'launch_rockets'" in tok.decode(teacher)

    n = len(tokens)
    plain = Sequence(0, tokens[:50], kinds[:50], kinds[:50] != 0, np.zeros(50), np.zeros(50))
    hinted = Sequence(1, tokens, kinds, kinds == SegmentKind.THINKING, np.zeros(n), np.zeros(n))
    hinted.teacher_tokens, hinted.teacher_target_index = teacher, target
    batch = pack_trajectories(
        [plain, hinted], np.array([0, 0]), {"task": np.zeros(2)}, n + 60, teacher_seq_len=n + 300
    )
    index = np.asarray(batch.teacher_index_BT)
    rows, cols = np.nonzero(index >= 0)
    assert len(rows) == spans[1][1] - spans[1][0]
    assert np.all(rows == 0) and cols[0] == 50 + spans[1][0] and np.all(np.diff(cols) == 1)
    teacher_flat = np.asarray(batch.teacher_tokens_BT).reshape(-1)
    np.testing.assert_array_equal(teacher_flat[index[rows, cols]], batch.tokens_BT[rows, cols])
    assert tok.decode(batch.tokens_BT[rows, cols]) == ROCKETS
