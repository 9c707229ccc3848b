"""Built-in repository tasks: a small package with one function's body removed, graded by hidden
cases; deterministic, split by function (neighbours too), solved by the oracle, failed by the stub."""

import ast
import builtins
import keyword
import random

import pytest

from composer_jax import envs
from composer_jax.envs.tasks import builtin_repo
from composer_jax.envs.tasks.builtin_tasks import (
    _OPS,
    FunctionSpec,
    function_name,
    random_spec,
    spec_of,
    split_of,
)
from composer_jax.envs.tasks.focus import open_tab

SOURCE = "builtin_repo:max_ops=2"


def test_tasks_are_deterministic_and_name_what_they_ask_for():
    first = envs.load_task_source(SOURCE).take(5, "train", seed=3)
    again = envs.load_task_source(SOURCE).take(5, "train", seed=3)
    assert [t.to_json() for t in first] == [t.to_json() for t in again]
    assert [t.task_id for t in first] != [
        t.task_id for t in envs.load_task_source(SOURCE).take(5, "train", 4)
    ]
    for task in first:
        name = function_name(spec_of(task))
        path = next(iter(task.oracle_files))
        assert f"`{name}` in {path}" in task.prompt and "docstring" in task.prompt
        stub = ast.parse(task.files[path])
        functions = {f.name: f for f in stub.body if isinstance(f, ast.FunctionDef)}
        assert len(functions) == 3  # the target and two neighbours
        assert ast.get_docstring(functions[name]).startswith("x is ")
        assert ast.unparse(functions[name].body[-1]) == "raise NotImplementedError"
        assert task.grader["module"] == path.removesuffix(".py").replace("/", ".")


def test_the_oracle_passes_and_the_stub_fails_every_hidden_case():
    for task in envs.load_task_source(SOURCE).take(4, "train", seed=0):
        assert envs.grade_solution(task, task.oracle_files).reward == 1.0
        assert envs.grade_solution(task, {}).reward == 0.0


def test_no_function_is_named_as_a_builtin_its_body_would_call_itself_through():
    """A one-step function is named by its step alone: `sum` would shadow the builtin its body
    calls, recurse, and leave a task that its own oracle fails."""
    for index, op in enumerate(_OPS):
        spec = FunctionSpec(op.kind.split("->")[0], ((index, tuple(p[0] for p in op.params)),))
        name = function_name(spec)
        assert not hasattr(builtins, name) and not keyword.iskeyword(name), name
    total = next(i for i, op in enumerate(_OPS) if op.code == "x = sum(x)")
    task = builtin_repo.make_repo_task(
        FunctionSpec("list", ((total, ()),)), random.Random(0), "sum-task", 2, 1
    )
    assert envs.grade_solution(task, task.oracle_files).reward == 1.0


def test_the_visible_test_runs_in_the_sandbox_and_names_a_wrong_result():
    task = envs.load_task_source(SOURCE).take(1, "train", seed=1)[0]
    config = envs.EnvConfig(tools=("run_tests", "write_file"), require_isolation=False)
    with envs.Episode(task, config) as episode:
        result = episode.step(envs.render_call("run_tests", {}))
        assert "NotImplementedError" in result.observation and "exit code 1" in result.observation
        # A wrong result is named with what was expected, as pytest's assertion rewriting would.
        path, solved = next(iter(task.oracle_files.items()))
        assert "\n    return x\n" in solved
        wrong = solved.replace("\n    return x\n", "\n    return None\n")
        episode.step(envs.render_call("write_file", {"path": path, "content": wrong}))
        result = episode.step(envs.render_call("run_tests", {}))
        assert "returned None, expected" in result.observation, result.observation
        assert "exit code 1" in result.observation


def test_a_step_that_edited_the_open_tab_returns_it_as_the_file_is_now(tmp_path):
    task = envs.load_task_source(SOURCE).take(1, "train", seed=1)[0]
    path = next(iter(task.oracle_files))
    config = envs.EnvConfig(tools=("write_file",), open_tab_lines=40, require_isolation=False)
    with envs.Episode(task, config) as episode:
        unchanged = episode.step(
            envs.render_call("write_file", {"path": "notes.txt", "content": ""})
        )
        assert "open_tab" not in unchanged.info  # the first observation's tab still holds
        edited = episode.step(
            envs.render_call("write_file", {"path": path, "content": task.oracle_files[path]})
        )
        tab = edited.info["open_tab"]
        assert tab == open_tab(task, 40, task.oracle_files) != open_tab(task, 40)
        assert tab.startswith(f"Open in the editor: {path}") and "NotImplementedError" not in tab
        # A file swapped for a link out of the workspace is never read for the tab.
        (tmp_path / "secret.py").write_text(task.oracle_files[path].replace("x", "SECRET"))
        target = episode.sandbox.workspace / path
        target.unlink()
        target.symlink_to(tmp_path / "secret.py")
        linked = episode.step(envs.render_call("write_file", {"path": "notes.txt", "content": ""}))
        assert "open_tab" not in linked.info


def _defined(task):
    """(module, function) of every function in the task's repository."""
    path = next(iter(task.oracle_files))
    tree = ast.parse(task.oracle_files[path])
    return {(path, f.name) for f in tree.body if isinstance(f, ast.FunctionDef)}


def test_held_out_functions_appear_in_no_training_repository():
    source = envs.load_task_source(SOURCE)
    held_out = set()
    for task in source.take(60, "held_out"):
        held_out.add((next(iter(task.oracle_files)), function_name(spec_of(task))))
    for task in source.take(60, "train", seed=0):
        assert task.split == "train"
        assert not _defined(task) & held_out, _defined(task) & held_out


def test_distinct_functions_have_distinct_names_within_a_kind():
    import random

    rng = random.Random(0)
    names = {}
    for _ in range(5000):
        spec = random_spec(rng, 2)
        names.setdefault((spec.input_kind, function_name(spec)), set()).add(spec.key())
    assert all(len(keys) == 1 for keys in names.values())
    assert all(name.isidentifier() for _, name in names)
    assert {split_of(random_spec(rng, 2)) for _ in range(200)} == {"train", "held_out"}


def test_a_variant_is_a_fresh_instance_of_the_same_function():
    source = envs.load_task_source(SOURCE)
    task = source.take(1, "train", seed=0)[0]
    fresh = source.variant(task, seed=7)
    assert fresh.task_id == f"{task.task_id}-v7" and spec_of(fresh) == spec_of(task)
    assert fresh.grader["cases"] != task.grader["cases"]
    assert envs.grade_solution(fresh, fresh.oracle_files).reward == 1.0


@pytest.mark.parametrize("options", ["max_ops=4", "neighbours=9"])
def test_bad_options_are_named(options):
    with pytest.raises(envs.TaskSourceError, match="builtin_repo"):
        envs.load_task_source(f"builtin_repo:{options}")


def test_a_split_with_too_few_functions_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setattr(builtin_repo, "REPEATS_BEFORE_EXHAUSTED", 500)
    with pytest.raises(ValueError, match=r"max_ops=1 has only \d+ distinct train functions"):
        envs.load_task_source("builtin_repo").take(500, "train", seed=0)
