"""The pytest verdict comes from the process the candidate's code runs in; what that code can do
to it is worth nothing: a line it writes on the verdict's descriptor lacks the run's nonce, the
runner's own names are out of its reach, reading the process's memory (where the nonce is) is
refused, and a test's replayed calls count only all together."""

import types

import pytest

from composer_jax.envs.grading import harness
from composer_jax.envs.grading.task import _replay_result, grade_solution
from tests.envs.grading.test_repo_grading import ATTACK_TASKS, _module_attack, attack_task
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
# Reads (or tries to) the process's memory, directly and through a link.
_READ_MEMORY = """
import os as _os
for _path in ("/proc/self/mem", "/tmp/cj_memory"):
    try:
        if _path.startswith("/tmp"):
            _os.symlink("/proc/self/mem", _path)
        open(_path, "rb").close()
    except OSError:
        pass
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
    assert result.scores["blocked"] == 2.0, result.scores


def _call(test, expected):
    return {"test": test, "input": harness.encode([[], {}])}, expected


def test_a_tests_calls_count_only_all_together():
    """A body that raises ValueError whatever it is given, under a verdict passing both tests:
    test A expects a value and then the ValueError, test B only the ValueError. Only B's call
    counts (A's matched raise does not: A as a whole fails)."""
    value = {"result": ["value", harness.encode(1)], "args_after": None}
    raised = {"result": ["raise", "builtins.ValueError"], "args_after": None}
    calls, expected = zip(_call("A", value), _call("A", raised), _call("B", raised))
    grader = {"replay": {"calls": list(calls), "expected": list(expected)}}
    task = types.SimpleNamespace(grader=grader, graded_tests=("A", "B"))
    result = _replay_result(task, {"A": "pass", "B": "pass"}, "", {}, [raised] * 3)
    assert result.reward == pytest.approx(1 / 3)
    assert result.outcomes == {"A": "replay_mismatch", "B": "pass"} and result.passed == 1
