"""Repository task sets: the files `launch.make_tasks` writes and the `repositories` source reads.

A set is JSON lines (gzip-compressed when the name ends in `.gz`): a `{"repository": {...}}`
record (`repo_factory.Repository`: name, version, source, source_roots, test_paths, ini,
files) before the tasks that use it, then one record per task:

    {"id": "toolz/toolz/itertoolz.py:interleave", "repository": "toolz",
     "path": "toolz/itertoolz.py", "deletion": ["interleave", first_line, last_line, indent],
     "graded_tests": ["toolz/tests/test_itertoolz.py::test_interleave"], "split": "train",
     "replay": {"module", "qualname", "calls": [{"test", "input"}, ...], "expected": [...]},
     "replay_counts": {"recorded", "not_plain_data", "replayed", "tests_without_replay"}}

`replay` (optional) is what replay grading calls the function on and the original's outcomes
(see `grading.replay`); a task without it is graded by its tests alone.

The repository's files are stored once; each task is rebuilt from its deletion, so a set of
hundreds of tasks over one package costs the package once. The sets shipped with the project
live in `composer_jax/envs/tasks/data/repositories/`.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from composer_jax.envs.grading import replay, repo_grading
from composer_jax.envs.grading.task import Task
from composer_jax.envs.tasks.repo_factory import Repository, make_task

SHIPPED_DIR = Path(__file__).parent / "data" / "repositories"


class TaskSetError(ValueError):
    """A task-set file that cannot be read as written (the message names the line)."""


def _open(path: Path, mode: str):
    return (
        gzip.open(path, mode + "t", encoding="utf-8")
        if path.suffix == ".gz"
        else open(path, mode, encoding="utf-8")
    )


def write_task_set(path: str | Path, repo: Repository, tasks: list[Task]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _open(path, "w") as f:
        f.write(json.dumps({"repository": repo.to_json()}, sort_keys=True) + "\n")
        for task in tasks:
            record = {
                "id": task.task_id,
                "repository": repo.name,
                "path": task.metadata["path"],
                "deletion": task.metadata["deletion"],
                "graded_tests": list(task.graded_tests),
                "split": task.split,
            }
            if "replay" in task.grader:
                record["replay"] = task.grader["replay"]
                record["replay_counts"] = task.metadata.get("replay", {})
            f.write(json.dumps(record) + "\n")


def read_task_set(path: str | Path) -> list[Task]:
    """Every task of the file, each hiding the installed copies of its package; a task no graded
    test of which checks a value (`replay.value_tests`, a set written before that rule) is left
    out."""
    path = Path(path)
    if not path.is_file():
        raise TaskSetError(f"{path}: no such task set")
    repos: dict[str, Repository] = {}
    tasks = []
    with _open(path, "r") as f:
        for number, line in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
                if "repository" in record and isinstance(record["repository"], dict):
                    repo = Repository.from_json(record["repository"])
                    repos[repo.name] = repo
                    continue
                repo = repos[record["repository"]]
                task = make_task(
                    repo,
                    record["path"],
                    tuple(record["deletion"]),
                    record["graded_tests"],
                    record.get("split", "train"),
                    replay=record.get("replay"),
                    replay_counts=record.get("replay_counts"),
                )
            except (ValueError, KeyError, TypeError) as error:
                raise TaskSetError(f"{where}: not a task-set record ({error!r})") from None
            if task.task_id != record["id"]:
                raise TaskSetError(f"{where}: id {record['id']!r} does not match its deletion")
            if "replay" in task.grader and not replay.value_tests(task.grader["replay"]):
                continue  # as the factory now drops it: a body that only raises passes it
            hidden = repo_grading.installed_copies(repo.source_roots)
            tasks.append(_with_hidden(task, hidden))
    return tasks


def read_repository(path: str | Path) -> Repository:
    """The repository record a set starts with."""
    path = Path(path)
    try:
        with _open(path, "r") as f:
            return Repository.from_json(json.loads(f.readline())["repository"])
    except (OSError, ValueError, KeyError, TypeError, EOFError) as error:
        raise TaskSetError(f"{path}:1: not a repository record ({error!r})") from None


def _with_hidden(task: Task, hidden: tuple[str, ...]) -> Task:
    paths = tuple(sorted({*task.hidden_paths, *hidden}))
    grading = tuple(sorted({*task.grading_hidden_paths, *hidden}))
    return Task(**{**task.__dict__, "hidden_paths": paths, "grading_hidden_paths": grading})


def is_task_set(path: str | Path) -> bool:
    """Whether a file is a repository task set (its first record names a repository)."""
    path = Path(path)
    try:
        with _open(path, "r") as f:
            return f.readline().lstrip().startswith('{"repository": {')
    except (OSError, UnicodeDecodeError, EOFError):
        return False


def shipped_sets() -> dict[str, Path]:
    """The task sets that come with the project, by repository name."""
    return {p.name.split(".")[0]: p for p in sorted(SHIPPED_DIR.glob("*.jsonl*"))}
