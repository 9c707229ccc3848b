"""What a task is and how it is graded: hidden tests run in the sandbox after the episode.

A task's test command prints one line `CJ_RESULT {"tests": {test_id: outcome}}` (outcome "pass",
"fail", "error" or "skip"). The reward is the fraction of the graded tests that pass; the hidden
files are mounted read-only at grading time only, so the agent never sees them.
"""

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

from composer_jax.envs.sandbox import Sandbox, SandboxLimits

RESULT_PREFIX = "CJ_RESULT "
HIDDEN_MOUNT = "/hidden"


@dataclasses.dataclass(frozen=True)
class Task:
    """A coding task.

    files: the initial workspace. hidden_files: test files mounted at grading only.
    test_command: run at grading, with `{hidden}` replaced by where the hidden files are.
    visible_test_command: what the `run_tests` tool runs (None: the tool reports no tests).
    graded_tests: the test ids that count (None: all reported tests).
    protected_paths: workspace files the agent must not modify or delete.
    hidden_paths: host paths masked inside the sandbox during the episode (the original code).
    grading_hidden_paths: host paths still masked while grading.
    test_literals: literal inputs of the hidden tests (for the special-casing monitor).
    oracle_files: files that solve the task (for SFT data and the oracle test).
    """

    task_id: str
    prompt: str
    files: dict[str, str]
    hidden_files: dict[str, str]
    test_command: str
    visible_test_command: str | None = None
    graded_tests: tuple[str, ...] | None = None
    protected_paths: tuple[str, ...] = ()
    hidden_paths: tuple[str, ...] = ()
    grading_hidden_paths: tuple[str, ...] = ()
    test_literals: tuple[str, ...] = ()
    oracle_files: dict[str, str] = dataclasses.field(default_factory=dict)
    split: str = "train"
    family: str = ""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Task":
        data = dict(data)
        for key in ("graded_tests", "protected_paths", "hidden_paths", "grading_hidden_paths"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        data["test_literals"] = tuple(data.get("test_literals", ()))
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class GradeResult:
    reward: float
    passed: int
    total: int
    outcomes: dict[str, str]
    log: str


def parse_results(output: str) -> dict[str, str] | None:
    """The outcomes of the last CJ_RESULT line, or None when there is none (or it is garbage)."""
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_PREFIX):
            try:
                tests = json.loads(line[len(RESULT_PREFIX) :])["tests"]
            except (ValueError, KeyError, TypeError):
                return None
            if isinstance(tests, dict):
                return {str(k): str(v) for k, v in tests.items()}
            return None
    return None


def grade(sandbox: Sandbox, task: Task, limits: SandboxLimits | None = None) -> GradeResult:
    """Runs the hidden tests against the sandbox's workspace."""
    hidden_dir = Path(tempfile.mkdtemp(prefix="cj_hidden_"))
    try:
        for name, content in task.hidden_files.items():
            (hidden_dir / name).write_text(content, encoding="utf-8")
        if sandbox.isolated:
            where, binds = HIDDEN_MOUNT, {str(hidden_dir): HIDDEN_MOUNT}
        else:
            where, binds = str(hidden_dir), {}
        result = sandbox.run(
            task.test_command.format(hidden=where),
            limits=limits,
            extra_ro_binds=binds,
            hidden_paths=task.grading_hidden_paths,
        )
    finally:
        shutil.rmtree(hidden_dir, ignore_errors=True)
    outcomes = parse_results(result.output) or {}
    graded = task.graded_tests if task.graded_tests is not None else tuple(outcomes)
    passed = sum(outcomes.get(test) == "pass" for test in graded)
    reward = passed / len(graded) if graded else 0.0
    return GradeResult(reward, passed, len(graded), outcomes, result.output[-2000:])
