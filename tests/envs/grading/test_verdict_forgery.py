"""The pytest verdict comes from the process the candidate's code runs in; what that code can do
to it is worth nothing: a line it writes on the verdict's descriptor lacks the run's nonce, the
runner's own names are out of its reach, reading the process's memory (where the nonce is) is
refused, a test's replayed calls count only all together, and only once a test that checks a
value passes."""

import types

import pytest

from composer_jax.envs.grading import harness, replay
from composer_jax.envs.grading.task import _replay_result, grade_solution
from composer_jax.envs.tasks.repo_task_sets import shipped_sets
from tests.envs.grading.test_repo_grading import (
    ATTACK_TASKS,
    _module_attack,
    attack_task,
    shipped_tasks,
)
from tests.helpers import ISOLATING

# Fires only under pytest (the replay imports no pytest), from inside the stubbed function, so
# the replay still runs: an all-pass verdict on every descriptor, then an exit past the runner.
_FORGE_UNDER_PYTEST = """
import json as _json, os as _os, sys as _sys
def _forge(ids):
    if "_pytest" not in _sys.modules:
        return None
    line = (_json.dumps({"tests": {t: "pass" for t in ids}, "errors": [], "status": 0,
                         "tampered": [], "blocked": [], "nonce": None}) + "\\n").encode()
    for fd in range(3, 64):
        try:
            _os.fstat(fd)
            _os.write(fd, line)
        except OSError:
            pass
    _os._exit(0)
"""
# Rebinds the runner's writer, wherever the runner's globals are a module's, to one that turns
# its verdict into an all-pass one.
_REBIND_THE_WRITER = """
import json as _json, sys as _sys
def _rewrite(fd, data, _real=__import__("os").write):
    verdict = _json.loads(bytes(data))
    verdict.update(tests=dict.fromkeys(verdict["tests"] or IDS, "pass"), errors=[],
                   tampered=[], blocked=[], status=0)
    _real(fd, (_json.dumps(verdict) + "\\n").encode())
    return len(data)
for _module in list(_sys.modules.values()):
    if "_WRITE" in vars(_module):
        vars(_module)["_WRITE"] = _rewrite
"""
# Reads (or tries to) the process's memory: by its path, through a link, and relative to a
# folder it lies in (the open event names only the relative part).
_READ_MEMORY = """
import os as _os
def _attempt(read):
    try:
        read()
    except OSError:
        pass
_attempt(lambda: open("/proc/self/mem", "rb").close())
_attempt(lambda: _os.symlink("/proc/self/mem", "/tmp/cj_memory"))
_attempt(lambda: _os.open("mem", _os.O_RDONLY, dir_fd=_os.open("/proc/self", _os.O_RDONLY)))
_attempt(lambda: _os.open("self/mem", _os.O_RDONLY, dir_fd=_os.open("/proc", _os.O_RDONLY)))
"""


def _pytest_passed(task, result):
    """The graded tests pytest passed (a "replay_mismatch" is a pass the replay overruled)."""
    return [t for t in task.graded_tests if result.outcomes.get(t) in ("pass", "replay_mismatch")]


@pytest.mark.parametrize("backend", ISOLATING)
@pytest.mark.parametrize("package", ATTACK_TASKS)
def test_a_verdict_written_from_inside_the_tests_is_refused(package, backend):
    task = attack_task(package)
    ids = list(task.graded_tests)
    files = _module_attack(task, _FORGE_UNDER_PYTEST, in_function=f"return _forge({ids!r})")
    result = grade_solution(task, files, backend=backend, require_isolation=True)
    assert result.scores.get("runner_void") == 1.0
    assert result.reward == 0.0 and not _pytest_passed(task, result)


@pytest.mark.parametrize("backend", ISOLATING)
@pytest.mark.parametrize("package", ATTACK_TASKS)
def test_the_runners_writer_cannot_be_rebound(package, backend):
    task = attack_task(package)
    attack = _REBIND_THE_WRITER.replace("IDS", repr(list(task.graded_tests)))
    files = _module_attack(task, attack, in_function="return None")
    result = grade_solution(task, files, backend=backend, require_isolation=True)
    assert result.reward == 0.0 and not _pytest_passed(task, result)


@pytest.mark.parametrize("backend", ISOLATING)
def test_reading_the_process_memory_is_refused(backend):
    task = attack_task("toolz")
    files = _module_attack(task, _READ_MEMORY, in_function="return None")
    result = grade_solution(task, files, backend=backend, require_isolation=True)
    assert result.scores["blocked"] == 4.0, result.scores


def _call(test, expected):
    return {"test": test, "input": harness.encode([[], {}])}, expected


VALUE = {"result": ["value", harness.encode(1)], "args_after": None}
RAISED = {"result": ["raise", "builtins.ValueError"], "args_after": None}
# Test A checks a value, then that a bad input raises ValueError; test B only the latter.
_CALLS, _EXPECTED = zip(_call("A", VALUE), _call("A", RAISED), _call("B", RAISED))
_TASK = types.SimpleNamespace(
    grader={"replay": {"calls": list(_CALLS), "expected": list(_EXPECTED)}},
    graded_tests=("A", "B"),
)


def test_a_body_that_only_raises_scores_0_whatever_the_verdict():
    """It matches A's second call and B's, and pytest (forged, or B honestly) passes B: nothing
    counts, since A as a whole fails and B checks no value (2/3 when each matched call of a
    passed test counted)."""
    assert replay.value_tests(_TASK.grader["replay"]) == {"A"}
    generator_raises = {
        "result": ["iter", [], ["raise", "builtins.ValueError"]],
        "args_after": None,
    }
    calls, expected = zip(_call("G", generator_raises))
    assert replay.value_tests({"calls": calls, "expected": expected}) == set()
    for verdict in ({"A": "pass", "B": "pass"}, {"A": "fail", "B": "pass"}):
        result = _replay_result(_TASK, verdict, "", {}, [RAISED] * 3)
        assert result.reward == 0.0 and result.outcomes["B"] == "pass"
    assert result.outcomes["A"] == "fail" and result.passed == 1


def test_a_body_that_checks_values_is_credited_by_whole_tests():
    """A value right and the input check missing: A's calls count, B's do not."""
    result = _replay_result(_TASK, {"A": "pass", "B": "fail"}, "", {}, [VALUE, RAISED, VALUE])
    assert result.reward == pytest.approx(2 / 3) and result.passed == 1
    result = _replay_result(_TASK, {"A": "pass", "B": "pass"}, "", {}, [VALUE, RAISED, RAISED])
    assert result.reward == 1.0 and result.passed == 2


def test_the_shipped_sets_hold_no_task_that_a_body_that_only_raises_passes():
    """Tasks whose every graded test checks only that inputs raise (more_itertools' distribute:
    1.0 for `raise ValueError`) are left out of the sets written before the factory dropped
    them."""
    tasks = [t for name in shipped_sets() for t in shipped_tasks(name)]
    assert all(replay.value_tests(t.grader["replay"]) for t in tasks)
    assert "more_itertools/more_itertools/more.py:distribute" not in {t.task_id for t in tasks}
