"""A task's target function and the open tab that shows it in the first observation."""

import dataclasses

from composer_jax import envs
from composer_jax.envs.tasks import focus
from composer_jax.envs.tasks.builtin_repo import STUB
from composer_jax.envs.tasks.repo_task_sets import read_task_set, shipped_sets


def repo_task():
    return envs.load_task_source("builtin_repo:max_ops=2").take(1, "train", seed=3)[0]


def test_the_tab_shows_the_target_function_as_read_file_would():
    task = repo_task()
    target = focus.target_of(task)
    assert target.name == task.grader["function"] and target.path in task.oracle_files
    path, first, last = focus.tab_span(task, 100)
    lines = task.files[path].splitlines(keepends=True)
    assert lines[first - 1].startswith(f"def {target.name}(") and lines[last - 1] == STUB
    tab = focus.open_tab(task, 100)
    assert tab.endswith("".join(lines[first - 1 : last])) and f"lines {first}-{last}" in tab
    config = envs.EnvConfig(open_tab_lines=100)
    assert tab in envs.episode_prompt(task, config)
    assert "Open in the editor" not in envs.episode_prompt(task, envs.EnvConfig())


def test_the_tab_is_cut_at_its_line_count_and_absent_without_a_target():
    task = repo_task()
    _, first, last = focus.tab_span(task, 2)
    assert last == first + 1 and focus.open_tab(task, 0) == ""
    drawing = envs.load_task_source("state_tracking").take(1, "test", seed=0)[0]
    assert focus.target_of(drawing) is None and focus.open_tab(drawing, 100) == ""
    moved = dataclasses.replace(task, files={})  # the target file is not in the workspace
    assert focus.open_tab(moved, 100) == ""


def test_a_repository_task_targets_its_deleted_function():
    task = read_task_set(shipped_sets()["toolz"])[0]
    qualname = task.metadata["deletion"][0]
    assert focus.target_of(task) == focus.Target(task.metadata["path"], qualname)
    node = focus.find_function(task.files[task.metadata["path"]], qualname)
    assert node is not None and qualname.endswith(node.name)
