"""The `TaskSource` interface every task family implements, and the finite `ListSource`.

A source yields `Task`s of a split, the same ones for the same seed, and knows its size when it
is finite; `composer_jax.envs.tasks.sources` names the families and parses specs.
"""

from __future__ import annotations

import abc
import itertools
import random
from collections.abc import Iterable, Iterator

from composer_jax.envs.grading.task import Task


class TaskSourceError(ValueError):
    """A spec that names no source, or a source that cannot be built from its arguments."""


class TaskSource(abc.ABC):
    """Tasks of a split, deterministic in the seed."""

    name: str = ""
    splits: tuple[str, ...] = ("train", "held_out")

    @abc.abstractmethod
    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        """The split's tasks in a fixed order for `seed` (possibly endless)."""

    def size(self, split: str = "train") -> int | None:
        """How many tasks the split has, or None when it is endless."""
        return None

    def variant(self, task: Task, seed: int) -> Task | None:
        """A fresh instance of `task` (the same problem, new inputs, a new id), or None when
        this source cannot make one. RL's hard-prompt emphasis revisits hard prompts this way,
        so no prompt is trained twice."""
        return None

    @property
    def eval_split(self) -> str:
        """The split an evaluation uses by default: "test", else "held_out", else "train"."""
        return next(s for s in ("test", "held_out", "train", *self.splits) if s in self.splits)

    def take(self, count: int, split: str = "train", seed: int = 0) -> list[Task]:
        """The first `count` tasks (fewer when the split has fewer)."""
        return list(itertools.islice(self.tasks(split, seed), count))

    def _check_split(self, split: str) -> None:
        if split not in self.splits:
            raise TaskSourceError(f"{self.name}: split must be one of {self.splits}, got {split!r}")


class ListSource(TaskSource):
    """A finite list of tasks, each in the split its `split` field names; shuffled by seed."""

    def __init__(self, name: str, tasks: Iterable[Task], splits: tuple[str, ...] | None = None):
        self.name = name
        self._tasks = list(tasks)
        self.splits = splits or tuple(sorted({t.split for t in self._tasks} | {"train"}))

    def _of(self, split: str) -> list[Task]:
        self._check_split(split)
        return [t for t in self._tasks if t.split == split]

    def tasks(self, split: str = "train", seed: int = 0) -> Iterator[Task]:
        chosen = self._of(split)
        random.Random(seed).shuffle(chosen)
        return iter(chosen)

    def size(self, split: str = "train") -> int | None:
        return len(self._of(split))
