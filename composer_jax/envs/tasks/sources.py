"""Where tasks come from: one `TaskSource` interface, chosen by a spec string.

A source yields `Task`s of a split, the same ones for the same seed, and knows its size when it
is finite. Specs (the same in config flags and in notebooks):

    builtin                       generated function tasks (infinite); builtin:max_ops=2
    builtin_repo                  those functions in a small repository, found, read, edited
                                  and tested by a multi-turn agent; builtin_repo:neighbours=3
    humaneval                     the 164 HumanEval problems (splits test / train / held_out)
    state_tracking                reproduce a file from its edit history (see state_tracking)
    jsonl:PATH                    tasks in a JSONL file (see jsonl_tasks for the schema)
    repositories                  real packages' functions, graded by their own pytest suites
                                  (the shipped sets; repositories:toolz:idna, or a set's path)
    builtin:0.7,humaneval:0.3     a weighted mixture (the last `:number` of each part)
    my_pkg.tasks:make_source      a researcher's own: a callable returning a TaskSource (or an
                                  iterable of Tasks), given the spec's further `:arg`s

Arguments after the name are `key=value` options or positional strings, separated by ':'.
Everything that names a task family lives here, in `envs/`: SFT data, RL prompts and held-out
evaluation all go through `load_task_source`.
"""

from __future__ import annotations

import functools
import importlib
import random
import re
from collections.abc import Callable, Iterable, Iterator

from composer_jax.config.base import ConfigError
from composer_jax.envs.grading.task import Task
from composer_jax.envs.tasks import (
    builtin_repo,
    humaneval,
    jsonl_tasks,
    repo_task_sets,
    state_tracking,
)
from composer_jax.envs.tasks.builtin_tasks import MAX_OPS, iter_builtin_tasks, task_variant
from composer_jax.envs.tasks.task_source import ListSource, TaskSource, TaskSourceError


class BuiltinSource(TaskSource):
    """The generated function tasks (`builtin_tasks`): endless, split by function."""

    name = "builtin"

    def __init__(self, max_ops: int | str = MAX_OPS):
        self.max_ops = int(max_ops)
        if not 1 <= self.max_ops <= MAX_OPS:
            raise TaskSourceError(f"builtin: max_ops must lie in [1, {MAX_OPS}]")

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        self._check_split(split)
        return iter_builtin_tasks(split, seed, self.max_ops)

    def variant(self, task: Task, seed: int) -> Task | None:
        return task_variant(task, seed) if task.family == "builtin" else None


class BuiltinRepoSource(TaskSource):
    """The built-in functions inside a small repository (`builtin_repo`): endless, split by
    function; `neighbours` documented functions beside the one to implement."""

    name = "builtin_repo"

    def __init__(self, max_ops: int | str = 1, neighbours: int | str = 2):
        self.max_ops, self.neighbours = int(max_ops), int(neighbours)
        if not 1 <= self.max_ops <= MAX_OPS:
            raise TaskSourceError(f"builtin_repo: max_ops must lie in [1, {MAX_OPS}]")
        if not 0 <= self.neighbours <= 6:
            raise TaskSourceError("builtin_repo: neighbours must lie in [0, 6]")

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        self._check_split(split)
        return builtin_repo.iter_repo_tasks(split, seed, self.max_ops, self.neighbours)

    def variant(self, task: Task, seed: int) -> Task | None:
        return builtin_repo.repo_task_variant(task, seed) if task.family == "builtin_repo" else None


class HumanEvalSource(TaskSource):
    name = "humaneval"

    splits = humaneval.SPLITS

    def tasks(self, split: str = "test", seed: int = 0) -> Iterator[Task]:
        self._check_split(split)
        tasks = humaneval.humaneval_tasks(split)
        random.Random(seed).shuffle(tasks)
        return iter(tasks)

    def size(self, split: str = "test") -> int | None:
        return len(humaneval.humaneval_tasks(split))


class MixtureSource(TaskSource):
    """Draws from several sources with fixed weights (deterministic in the seed); a finite part
    that runs out leaves the others to go on."""

    def __init__(self, parts: list[tuple[TaskSource, float]]):
        if not parts or any(w <= 0 for _, w in parts):
            raise TaskSourceError("a mixture needs parts with positive weights")
        self.parts = parts
        self.name = ",".join(f"{s.name}:{w:g}" for s, w in parts)
        self.splits = tuple(sorted(set.intersection(*(set(s.splits) for s, _ in parts))))

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        self._check_split(split)
        rng = random.Random(seed)
        live = [(s.tasks(split, seed + i), w) for i, (s, w) in enumerate(self.parts)]
        while live:
            index = rng.choices(range(len(live)), [w for _, w in live])[0]
            try:
                yield next(live[index][0])
            except StopIteration:
                del live[index]

    def size(self, split: str = "train") -> int | None:
        sizes = [s.size(split) for s, _ in self.parts]
        return None if None in sizes else sum(sizes)

    def variant(self, task: Task, seed: int) -> Task | None:
        return next((v for s, _ in self.parts if (v := s.variant(task, seed)) is not None), None)


class RepositorySource(ListSource):
    """Repository tasks from task sets (`repo_task_sets`): the shipped ones by name (all of them
    when none is named) or files by path. Every task must carry its replay: a set graded by its
    tests alone (whose verdict the candidate's process writes) is refused."""

    def __init__(self, *sets: str):
        shipped = repo_task_sets.shipped_sets()
        paths = []
        for name in sets or tuple(shipped):
            if name in shipped:
                paths.append(shipped[name])
            elif "/" in name or name.endswith((".jsonl", ".gz")):
                paths.append(name)
            else:
                raise TaskSourceError(
                    f"repositories: {name!r} is neither a shipped set ({', '.join(shipped)}) "
                    "nor a task-set path"
                )
        try:
            tasks = [t for path in paths for t in repo_task_sets.read_task_set(path)]
        except repo_task_sets.TaskSetError as error:
            raise TaskSourceError(str(error)) from None
        unreplayed = [t.task_id for t in tasks if "replay" not in t.grader]
        if unreplayed:
            raise TaskSourceError(
                f"repositories: {len(unreplayed)} tasks have no replay (e.g. {unreplayed[0]}); "
                "add it with python -m launch.make_tasks --from_set=PATH --out=NEW"
            )
        super().__init__("repositories", tasks, ("train", "held_out"))


def _jsonl(path: str, *args, **options) -> TaskSource:
    if repo_task_sets.is_task_set(path):  # `launch.make_tasks` output reads back as JSONL too
        return RepositorySource(path)
    return ListSource(f"jsonl:{path}", jsonl_tasks.load_jsonl_tasks(path, *args, **options))


SOURCES: dict[str, Callable[..., TaskSource]] = {
    "builtin": BuiltinSource,
    "builtin_repo": BuiltinRepoSource,
    "humaneval": HumanEvalSource,
    "state_tracking": state_tracking.StateTrackingSource,
    "jsonl": _jsonl,
    "repositories": RepositorySource,
}
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_WEIGHT = re.compile(r"^\d+(\.\d*)?([eE][-+]?\d+)?$|^\.\d+$")


def _one(part: str) -> TaskSource:
    head, _, rest = part.partition(":")
    if head not in SOURCES and _IMPORT_PATH.match(f"{head}:{rest.split(':')[0]}"):
        attr, *more = rest.split(":")
        try:
            factory = getattr(importlib.import_module(head), attr)
        except (ImportError, AttributeError) as error:
            raise TaskSourceError(f"task source {head}:{attr}: {error}") from None
        return _built(f"{head}:{attr}", factory, more)
    if head not in SOURCES:
        raise TaskSourceError(
            f"unknown task source {head!r}; known: {', '.join(sorted(SOURCES))}, a jsonl:PATH, "
            "a mixture (a:0.7,b:0.3) or an import path (pkg.module:function)"
        )
    return _built(head, SOURCES[head], rest.split(":") if rest else [])


def _built(name: str, factory, arguments: list[str]) -> TaskSource:
    args = [a for a in arguments if "=" not in a]
    options = dict(a.split("=", 1) for a in arguments if "=" in a)
    try:
        made = factory(*args, **options)
    except TypeError as error:
        raise TaskSourceError(f"task source {name}: {error}") from None
    if isinstance(made, TaskSource):
        return made
    if isinstance(made, Iterable):
        return ListSource(name, made)
    raise TaskSourceError(f"task source {name} returned {type(made).__name__}, not a TaskSource")


def load_task_source(spec: str) -> TaskSource:
    """The source a spec names (see the module docstring)."""
    spec = spec.strip()
    if not spec:
        raise TaskSourceError("empty task source spec")
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) == 1:
        return _one(parts[0])
    weighted = []
    for part in parts:
        body, _, weight = part.rpartition(":")
        if not body or not _WEIGHT.match(weight):
            raise TaskSourceError(f"mixture part {part!r} needs a weight: name:0.5")
        weighted.append((_one(body), float(weight)))
    return MixtureSource(weighted)


def task_source(spec: str, field: str) -> TaskSource:
    """The task source `spec` names, or a ConfigError naming the config field."""
    try:
        return load_task_source(spec)
    except (TaskSourceError, jsonl_tasks.JsonlTaskError) as error:
        raise ConfigError(f"{field}: {error}") from None


@functools.lru_cache(maxsize=8)
def drawn_tasks(spec: str, field: str, count: int, split: str, seed: int) -> tuple[Task, ...]:
    """`task_source(spec, field).take(count, split, seed)`, drawn once per process: a run's SFT
    examples and RL prompts are drawn again to keep them out of its held-out check, and some
    sources read or build their tasks at a cost (a repository set's file, HumanEval's package)."""
    return tuple(task_source(spec, field).take(count, split, seed))
