"""State tracking, in the spirit of LoCoDiff: given a file's history as a sequence of diffs,
write the file as it is after the last one.

Histories are synthetic but over real code: a window of a standard-library module is the first
commit (a diff from nothing), then each commit inserts, deletes or replaces a few lines (inserted
lines come from other real modules). History lengths grow (1, 2, 4, 8, 16 commits by default), so
a report shows how exact match and similarity fall with length. Graded by the `file` grader:
test "exact" (the reward) and the line-level similarity score. Everything is a function of the
seed.
"""

from __future__ import annotations

import difflib
import functools
import os
import random
import sysconfig
from collections.abc import Iterator

from composer_jax.envs.grading.task import Task
from composer_jax.envs.tasks.task_source import TaskSource, TaskSourceError

DEFAULT_LENGTHS = (1, 2, 4, 8, 16)


@functools.cache
def _corpus(min_lines: int) -> tuple[str, ...]:
    """Paths of stdlib modules long enough to cut windows from, sorted."""
    stdlib = sysconfig.get_paths()["stdlib"]
    paths = []
    for name in sorted(os.listdir(stdlib)):
        path = os.path.join(stdlib, name)
        if name.endswith(".py") and os.path.getsize(path) < 200_000:
            with open(path, encoding="utf-8", errors="replace") as f:
                if sum(1 for _ in f) >= min_lines:
                    paths.append(path)
    return tuple(paths)


def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read().splitlines(keepends=True)


def _edit(lines: list[str], donor: list[str], rng: random.Random) -> list[str]:
    """One commit: insert, delete or replace 1-3 lines at a random place."""
    lines = list(lines)
    count = rng.randint(1, 3)
    at = rng.randrange(len(lines) + 1)
    start = rng.randrange(max(1, len(donor) - count))
    new = donor[start : start + count]
    kind = rng.choice(("insert", "delete", "replace")) if len(lines) > count + 2 else "insert"
    if kind == "insert":
        lines[at:at] = new
    else:
        at = min(at, len(lines) - count)
        lines[at : at + count] = [] if kind == "delete" else new
    return lines


def make_history(rng: random.Random, length: int, window: int = 40) -> tuple[str, list[str], str]:
    """(file name, `length` unified diffs oldest first, final content)."""
    corpus = _corpus(window * 2)
    if not corpus:
        raise TaskSourceError("state_tracking: no standard-library module is long enough")
    source = _lines(rng.choice(corpus))
    start = rng.randrange(len(source) - window)
    current = source[start : start + window]
    name = f"module_{rng.randrange(10**6):06d}.py"
    diffs = [_diff([], current, name)]
    for _ in range(length - 1):
        donor = _lines(rng.choice(corpus))
        after = _edit(current, donor, rng)
        diffs.append(_diff(current, after, name))
        current = after
    return name, diffs, "".join(current)


def _diff(before: list[str], after: list[str], name: str) -> str:
    fromfile = "/dev/null" if not before else f"a/{name}"
    return "".join(
        difflib.unified_diff(_terminated(before), _terminated(after), fromfile, f"b/{name}")
    )


def _terminated(lines: list[str]) -> list[str]:
    """Lines for difflib: a missing final newline shown the way `diff` shows it."""
    if lines and not lines[-1].endswith("\n"):
        return [*lines[:-1], lines[-1] + "\n\\ No newline at end of file\n"]
    return lines


class StateTrackingSource(TaskSource):
    """`per_length` tasks for each history length in `lengths` ("1-2-4-8-16")."""

    name = "state_tracking"
    splits = ("test",)

    def __init__(self, per_length: int | str = 8, lengths: str = "", window: int | str = 40):
        self.per_length, self.window = int(per_length), int(window)
        self.lengths = tuple(int(n) for n in lengths.split("-")) if lengths else DEFAULT_LENGTHS
        if self.per_length < 1 or self.window < 4 or min(self.lengths) < 1:
            raise TaskSourceError("state_tracking: per_length >= 1, window >= 4, lengths >= 1")

    def tasks(self, split: str = "test", seed: int = 0) -> Iterator[Task]:
        self._check_split(split)
        for length in self.lengths:
            for index in range(self.per_length):
                rng = random.Random(f"state-tracking-{seed}-{length}-{index}")
                name, diffs, final = make_history(rng, length, self.window)
                history = "".join(f"commit {i + 1}\n{d}\n" for i, d in enumerate(diffs))
                yield Task(
                    task_id=f"state-{length:02d}-{index:03d}",
                    prompt=(
                        f"Below is the history of `{name}` as {length} commit(s), each a unified "
                        f"diff, oldest first. Write the file exactly as it is after the last "
                        f"commit to {name}.\n\n{history}"
                    ),
                    files={},
                    grader={"kind": "file", "path": name, "expected": final},
                    graded_tests=("exact",),
                    oracle_files={name: final},
                    split="test",
                    family="state_tracking",
                    metadata={"history_length": length},
                    group=f"history_length={length}",
                )

    def size(self, split: str = "test") -> int | None:
        self._check_split(split)
        return self.per_length * len(self.lengths)
