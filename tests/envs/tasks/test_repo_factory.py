"""The repository task factory on a package it has never seen: verified tasks without code
changes, and every bad input dropped or refused with its reason, never a crash."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from composer_jax.envs.grading.task import grade_solution
from composer_jax.envs.tasks import repo_factory
from composer_jax.envs.tasks.repo_task_sets import read_task_set, write_task_set
from composer_jax.envs.tasks.sources import TaskSourceError, load_task_source
from tests.helpers import ISOLATING

REPO = Path(__file__).resolve().parents[3]

_CORE = '''
def add_all(values):
    """The sum of the values."""
    total = 0
    for value in values:
        total += value
    return total


def reverse_words(text):
    words = text.split()
    return " ".join(reversed(words))


class Clamp:
    def __init__(self, low, high):
        self.low = low
        self.high = high

    def apply(self, x):
        """x within [low, high]."""
        if x < self.low:
            return self.low
        return min(x, self.high)


def log_call(x):
    message = f"called {x}"
    return message
'''
_TESTS = """
from tinypkg.core import Clamp, add_all, log_call, reverse_words


def test_add_all():
    assert add_all([1, 2, 3]) == 6


def test_reverse_words():
    assert reverse_words("a b c") == "c b a"


def test_clamp():
    assert Clamp(0, 5).apply(9) == 5
    assert Clamp(0, 5).apply(-1) == 0


def test_log_call_runs():
    try:
        log_call(3)
    except Exception:
        pass
"""


def write_package(root: Path, tests: str = _TESTS) -> Path:
    (root / "tinypkg").mkdir(parents=True)
    (root / "tinypkg" / "__init__.py").write_text("")
    (root / "tinypkg" / "core.py").write_text(textwrap.dedent(_CORE))
    (root / "tests").mkdir()
    (root / "tests" / "test_core.py").write_text(textwrap.dedent(tests))
    (root / "LICENSE").write_text("MIT\n")
    return root


def test_a_new_package_becomes_verified_tasks_through_the_command(tmp_path):
    package = write_package(tmp_path / "tinypkg-src")
    out = tmp_path / "tiny.jsonl.gz"
    result = subprocess.run(
        [sys.executable, "-m", "launch.make_tasks", f"--path={package}", f"--out={out}"]
        + ["--held_out=0.6", "--backend=auto"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 of 5 candidates kept" in result.stdout
    assert "1 tests pass with the deletion" in result.stdout
    # A method's calls carry `self`, which is not plain data: nothing to replay.
    assert "2 no call with plain-data arguments" in result.stdout
    tasks = read_task_set(out)
    names = {t.task_id.rsplit(":", 1)[1] for t in tasks}
    assert names == {"add_all", "reverse_words"}
    for task in tasks:
        assert task.grader["replay"]["calls"] and task.metadata["replay"]["replayed"] >= 1
        assert grade_solution(task, task.oracle_files).reward == 1.0
        assert grade_solution(task, {}).reward == 0.0
    # Held out: the ids whose hash falls under the fraction (add_all's is 0.54, reverse_words'
    # 0.78), so one task lands in each split.
    splits = {t.task_id.rsplit(":", 1)[1]: t.split for t in tasks}
    assert splits == {"add_all": "held_out", "reverse_words": "train"}
    source = load_task_source(f"repositories:{out}")
    assert source.size("train") == source.size("held_out") == 1


def test_a_set_made_without_replay_gets_it_with_the_same_ids_and_splits(tmp_path):
    package = write_package(tmp_path / "tinypkg-src")
    repo = repo_factory.find_layout(package, "tinypkg", "0", "path")
    path, tests = "tinypkg/core.py", ["tests/test_core.py::test_add_all"]
    deletion = next(
        d for d in repo_factory.deletable_functions(repo.files[path]) if d[0] == "add_all"
    )
    old = tmp_path / "old.jsonl"
    write_task_set(old, repo, [repo_factory.make_task(repo, path, deletion, tests, "held_out")])
    with pytest.raises(TaskSourceError, match="1 tasks have no replay.*--from_set"):
        load_task_source(f"repositories:{old}")  # graded by its tests alone: never used
    new = tmp_path / "new.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "launch.make_tasks", f"--from_set={old}", f"--out={new}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (task,) = read_task_set(new)
    assert (task.task_id, task.split) == ("tinypkg/tinypkg/core.py:add_all", "held_out")
    assert [c["test"] for c in task.grader["replay"]["calls"]] == tests


def test_a_folder_without_a_package_is_refused_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "launch.make_tasks", f"--path={tmp_path / 'empty'}"]
        + [f"--out={tmp_path / 'x.jsonl'}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "no Python package" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        ([], "--out is required"),
        (["--out=x.jsonl"], "give exactly one of --package, --path and --from_set"),
        (["--out=x.jsonl", "--path=/nonexistent"], "--path=/nonexistent: no such folder"),
    ],
)
def test_usage_errors_are_one_line(args, needle):
    """Not the whole help text after them."""
    result = subprocess.run(
        [sys.executable, "-m", "launch.make_tasks", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stderr == f"error: {needle}\n", result.stderr


def test_a_suite_that_does_not_run_is_refused(tmp_path):
    package = write_package(tmp_path / "broken", tests="def test_x(:\n    pass\n")
    repo = repo_factory.find_layout(package, "broken", "0", "path")
    with pytest.raises(repo_factory.FactoryError, match="no test passes"):
        repo_factory.build_tasks(repo)


@pytest.mark.slow
def test_a_package_from_the_registry_becomes_verified_tasks(tmp_path):
    """One more small package, fetched by pip from the configured registry (network)."""
    out = tmp_path / "inflection.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "launch.make_tasks", "--package=inflection==0.5.1"]
        + [f"--out={out}", f"--cache={tmp_path / 'sdists'}", "--max_tasks=6"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    tasks = read_task_set(out)
    assert len(tasks) == 6
    for task in tasks[:2]:
        assert grade_solution(task, task.oracle_files).reward == 1.0
        assert grade_solution(task, {}).reward == 0.0


_ESCAPING_TEST = """

def test_writes_outside_its_tree():
    with open({outside!r}, "w") as f:
        f.write("the survey ran on the host")


def test_reaches_the_network():
    import socket

    socket.create_connection(("1.1.1.1", 53), timeout=2).close()
"""


@pytest.mark.parametrize("backend", ISOLATING)
def test_the_survey_runs_sandboxed(tmp_path, backend):
    outside = tmp_path / "escaped.txt"
    package = write_package(tmp_path / "src", _TESTS + _ESCAPING_TEST.format(outside=str(outside)))
    repo = repo_factory.find_layout(package, "tinypkg", "0", "path")
    outcomes, coverage, _ = repo_factory.survey(repo, backend=backend)
    assert outcomes["tests/test_core.py::test_add_all"] == "pass"
    assert coverage["tests/test_core.py::test_add_all"] == [("tinypkg/core.py", "add_all")]
    assert outcomes["tests/test_core.py::test_writes_outside_its_tree"] != "pass"
    assert outcomes["tests/test_core.py::test_reaches_the_network"] != "pass"
    assert not outside.exists()
    # The control: run unisolated (as the survey ran before), the same suite writes the file.
    outcomes, _, _ = repo_factory.survey(repo, backend="rlimit")
    assert outcomes["tests/test_core.py::test_writes_outside_its_tree"] == "pass"
    assert outside.exists()


def test_a_corrupt_archive_is_refused_in_one_line(tmp_path):
    archive = tmp_path / "broken-1.0.tar.gz"
    archive.write_bytes(b"\x1f\x8b\x08 not a tar stream")
    with pytest.raises(repo_factory.FactoryError) as error:
        repo_factory.unpack_archive(archive, tmp_path / "broken-1.0")
    assert str(error.value).startswith("broken-1.0.tar.gz: not a readable archive")
    assert "\n" not in str(error.value) and not (tmp_path / "broken-1.0").exists()
