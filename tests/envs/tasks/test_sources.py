"""Task sources: specs, determinism by seed, sizes, mixtures, plug-ins by import path, JSONL
files (and their errors, naming line and field)."""

import json

import pytest

from composer_jax.envs.grading.task import grade_solution
from composer_jax.envs.tasks.jsonl_tasks import JsonlTaskError, load_jsonl_tasks
from composer_jax.envs.tasks.sources import TaskSourceError, load_task_source


def ids(tasks):
    return [t.task_id for t in tasks]


def test_builtin_is_endless_deterministic_and_split():
    source = load_task_source("builtin:max_ops=2")
    assert source.size("train") is None
    first = source.take(20, "train", seed=3)
    assert ids(first) == ids(source.take(20, "train", seed=3))
    assert ids(first) != ids(source.take(20, "train", seed=4))
    held_out = source.take(5, "held_out", seed=3)
    assert {t.split for t in first} == {"train"} and {t.split for t in held_out} == {"held_out"}
    with pytest.raises(TaskSourceError, match="max_ops"):
        load_task_source("builtin:max_ops=9")


def test_humaneval_source_sizes_and_seeded_order():
    source = load_task_source("humaneval")
    assert source.size("test") == 164
    assert source.size("train") + source.size("held_out") == 164
    assert ids(source.take(5, "test", seed=1)) == ids(source.take(5, "test", seed=1))
    assert sorted(ids(source.tasks("test", seed=1))) == sorted(ids(source.tasks("test", seed=2)))


def test_mixture_follows_its_weights_and_runs_finite_parts_dry():
    source = load_task_source("builtin:0.7,humaneval:0.3")
    assert source.size("train") is None and source.splits == ("held_out", "train")
    drawn = source.take(400, "train", seed=0)
    share = sum(t.family == "humaneval" for t in drawn) / len(drawn)
    assert 0.2 < share < 0.4 and ids(drawn) == ids(source.take(400, "train", seed=0))
    finite = load_task_source("humaneval:1,tests.envs.tasks.task_plugin:make_source:4:2")
    everything = list(finite.tasks("train", seed=5))
    assert (
        finite.size("train") == len(everything) == load_task_source("humaneval").size("train") + 4
    )


def test_a_source_from_an_import_path():
    source = load_task_source("tests.envs.tasks.task_plugin:make_source:count=2")
    tasks = source.take(10)
    assert ids(sorted(tasks, key=lambda t: t.task_id)) == ["plugin-0", "plugin-1"]
    assert all(grade_solution(t, t.oracle_files).reward == 1.0 for t in tasks)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("nope", "unknown task source"),
        ("builtin:0.5,nope:0.5", "unknown task source"),
        ("builtin,humaneval", "needs a weight"),
        ("tests.envs.tasks.task_plugin:missing", "missing"),
        ("", "empty"),
        ("humaneval:bogus=1", "humaneval"),
    ],
)
def test_bad_specs_are_named(spec, message):
    with pytest.raises(TaskSourceError, match=message):
        load_task_source(spec)


def _write(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return str(path)


GOOD = [
    {
        "id": "double",
        "prompt": "Write f(x) returning 2 * x.",
        "files": {"solution.py": "def f(x):\n    raise NotImplementedError\n"},
        "grader": {
            "kind": "cases",
            "module": "solution",
            "function": "f",
            "cases": [{"args": [2], "expected": 4}, {"args": [[1]], "expected": [1, 1]}],
        },
        "oracle_files": {"solution.py": "def f(x):\n    return x * 2\n"},
    },
    {
        "id": "check",
        "prompt": "Write inc.",
        "files": {"solution.py": "def inc(x):\n    raise NotImplementedError\n"},
        "grader": {
            "kind": "check",
            "module": "solution",
            "function": "inc",
            "check": "def check(candidate):\n    assert candidate(1) == 2\n",
        },
        "oracle_files": {"solution.py": "def inc(x):\n    return x + 1\n"},
        "split": "held_out",
    },
]


def test_jsonl_tasks_grade_by_their_oracles(tmp_path):
    path = _write(tmp_path / "tasks.jsonl", ["# a comment", "", *GOOD])
    tasks = load_jsonl_tasks(path)
    assert ids(tasks) == ["double", "check"]
    for task in tasks:
        assert grade_solution(task, task.oracle_files).reward == 1.0, task.task_id
        assert grade_solution(task, {}).reward == 0.0, task.task_id
    source = load_task_source(f"jsonl:{path}")
    assert source.size("train") == 1 and source.size("held_out") == 1


@pytest.mark.parametrize(
    "record,line,field",
    [
        ('{"id": "x",', 2, None),
        ({**GOOD[0], "id": "bad id!"}, 2, "id"),
        ({k: v for k, v in GOOD[0].items() if k != "prompt"}, 2, "prompt"),
        ({**GOOD[0], "grader": {"kind": "magic"}}, 2, "grader.kind"),
        (
            {**GOOD[0], "grader": {**GOOD[0]["grader"], "cases": [{"args": 1, "expected": 2}]}},
            2,
            "grader.cases[0].args",
        ),
        (
            {**GOOD[0], "grader": {"kind": "unittest", "modules": ["tests.test_x"]}},
            2,
            "grader.kind",
        ),
        ({**GOOD[0], "files": {"/etc/passwd": "x"}}, 2, "files"),
        ({**GOOD[0], "colour": "blue"}, 2, "colour"),
        (GOOD[0], 2, "id"),  # a duplicate of line 1
    ],
)
def test_jsonl_errors_name_the_line_and_field(tmp_path, record, line, field):
    path = _write(tmp_path / "tasks.jsonl", [GOOD[0], record])
    with pytest.raises(JsonlTaskError) as error:
        load_jsonl_tasks(path)
    assert f"tasks.jsonl:{line}:" in str(error.value)
    if field:
        assert f"field {field!r}" in str(error.value)
