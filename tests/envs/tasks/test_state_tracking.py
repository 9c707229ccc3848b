"""State-tracking tasks: every history replays to the expected file, the oracle scores 1 with
similarity 1, near misses score 0 with high similarity, lengths and seeds behave."""

import random
import re

from composer_jax.envs.grading.task import grade_solution
from composer_jax.envs.tasks.sources import load_task_source
from composer_jax.envs.tasks.state_tracking import make_history

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def apply_diff(lines: list[str], diff: str) -> list[str]:
    """A minimal unified-diff applier (an independent check of the generated histories)."""
    out, position = [], 0
    body = diff.splitlines(keepends=True)[2:]
    i = 0
    while i < len(body):
        match = _HUNK.match(body[i])
        start = int(match.group(1)) - (1 if match.group(2) != "0" else 0)
        out += lines[position:start]
        position = start
        i += 1
        while i < len(body) and not body[i].startswith("@@"):
            tag, text = body[i][0], body[i][1:]
            if i + 1 < len(body) and body[i + 1].startswith("\\"):
                text = text.removesuffix("\n")
                i += 1
            if tag in " -":
                assert lines[position] == text, (lines[position], text)
                position += 1
            if tag in " +":
                out.append(text)
            i += 1
    return out + lines[position:]


def test_histories_replay_to_the_final_file():
    for seed in range(40):
        rng = random.Random(seed)
        name, diffs, final = make_history(rng, 1 + seed % 16, window=30)
        lines: list[str] = []
        for diff in diffs:
            lines = apply_diff(lines, diff)
        assert "".join(lines) == final and name.endswith(".py")


def test_tasks_grade_exactly_with_a_similarity_score():
    source = load_task_source("state_tracking:per_length=2:lengths=1-8")
    tasks = list(source.tasks("test", seed=3))
    assert source.size("test") == len(tasks) == 4
    assert [t.metadata["history_length"] for t in tasks] == [1, 1, 8, 8]
    assert [t.task_id for t in tasks] == [t.task_id for t in source.tasks("test", seed=3)]
    task = tasks[-1]
    path = task.grader["path"]
    oracle = grade_solution(task, task.oracle_files)
    assert oracle.reward == 1.0 and oracle.scores["similarity"] == 1.0
    lines = task.oracle_files[path].splitlines(keepends=True)
    near = grade_solution(task, {path: "".join(lines[:-1])})
    assert near.reward == 0.0 and 0.9 < near.scores["similarity"] < 1.0
    assert grade_solution(task, {}).scores["similarity"] == 0.0
