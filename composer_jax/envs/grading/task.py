"""What a task is and how it is graded.

Grading runs `harness.py` in a fresh command of the episode's sandbox: the harness receives the
task's grader spec (expected answers, or the check or test code) and a random nonce on stdin,
runs the code under test in child processes, and prints one verdict line prefixed by the nonce.
The reward is the fraction of the task's graded tests (always named by the task) that passed.
No file of the hidden tests is ever written: neither this sample nor a sibling can read them,
and nothing the code under test prints can stand in for the verdict.
"""

import dataclasses
import json
import secrets
import shlex
from pathlib import Path

from composer_jax.envs.grading import harness, replay, repo_grading
from composer_jax.envs.sandbox.box import Sandbox, SandboxLimits
from composer_jax.envs.sandbox.isolation import WORKSPACE_MOUNT

GRADER_KINDS = ("cases", "check", "file", "pytest")
# Grading gets the room of a test suite (a repository's tests print a lot and take seconds).
GRADING_LIMITS = SandboxLimits(
    cpu_seconds=30, wall_seconds=60, memory_bytes=2 << 30, output_bytes=4 << 20
)
# The harness's program travels on the command line and its input on stdin, so that it can fork
# a child for the code under test before the answers reach it (see `harness`).
_HARNESS_COMMAND = "exec python3 -I -B -c " + shlex.quote(
    Path(harness.__file__).read_text(encoding="utf-8") + "\nmain()\n"
)
_REQUIRED = {
    "cases": ("module", "function", "cases"),
    "check": ("module", "function", "check"),
    "file": ("path", "expected"),
    "pytest": ("source_roots", "test_paths"),
}


class TaskError(ValueError):
    """A task that cannot be graded as written (unknown grader kind, missing fields...)."""


@dataclasses.dataclass(frozen=True)
class Task:
    """A coding task.

    files: the initial workspace. grader: how the hidden tests run (see `harness`):
      {"kind": "cases", "module", "function", "cases": [[args, expected], ...]} (encoded values),
      {"kind": "check", "module", "function", "check": source, "prelude": source},
      {"kind": "file", "path", "expected": text} (test "exact", score "similarity"),
      {"kind": "pytest", "source_roots", "test_paths", "ini"}: the repository's own tests
      (pytest node ids in graded_tests), run on the task's pristine tests with the agent's
      source modules (see `repo_grading`), gating the replay of their recorded calls
      ("replay", see `replay`) that sets the reward.
    graded_tests: the test ids that count (never empty).
    visible_test_command: what the `run_tests` tool runs (None: the tool reports no tests).
    protected_paths: workspace files the agent must not modify or delete.
    hidden_paths: host paths masked inside the sandbox during the episode (the original code).
    grading_hidden_paths: host paths still masked while grading.
    test_literals: literal inputs of the hidden tests (for the special-casing monitor).
    oracle_files: files that solve the task (for SFT data and the oracle test).
    metadata: JSON-able facts about the task (e.g. a built-in task's function, which its
      source uses to make fresh variants).
    group: what evaluation reports break results down by (e.g. "history_length=8"; "" none).
    """

    task_id: str
    prompt: str
    files: dict[str, str]
    grader: dict
    graded_tests: tuple[str, ...]
    visible_test_command: str | None = None
    protected_paths: tuple[str, ...] = ()
    hidden_paths: tuple[str, ...] = ()
    grading_hidden_paths: tuple[str, ...] = ()
    test_literals: tuple[str, ...] = ()
    oracle_files: dict[str, str] = dataclasses.field(default_factory=dict)
    split: str = "train"
    family: str = ""
    metadata: dict = dataclasses.field(default_factory=dict)
    group: str = ""

    def __post_init__(self):
        kind = self.grader.get("kind") if isinstance(self.grader, dict) else None
        if kind not in GRADER_KINDS:
            raise TaskError(f"task {self.task_id}: grader.kind must be one of {GRADER_KINDS}")
        missing = [k for k in _REQUIRED[kind] if k not in self.grader]
        if missing:
            raise TaskError(f"task {self.task_id}: a {kind!r} grader needs {missing}")
        if not self.graded_tests:
            raise TaskError(f"task {self.task_id}: graded_tests must name at least one test")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Task":
        data = dict(data)
        for key in (
            "graded_tests",
            "protected_paths",
            "hidden_paths",
            "grading_hidden_paths",
            "test_literals",
        ):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)


def case_tests(num_cases: int) -> tuple[str, ...]:
    """The test ids of a `cases` grader with `num_cases` cases."""
    return tuple(f"case_{i}" for i in range(num_cases))


def encode_value(value) -> list:
    """A Python value as the harness's tagged plain data (for `cases` graders)."""
    return harness.encode(value)


@dataclasses.dataclass(frozen=True)
class GradeResult:
    reward: float
    passed: int
    total: int
    outcomes: dict[str, str]
    log: str
    scores: dict[str, float] = dataclasses.field(default_factory=dict)  # e.g. "similarity"


def parse_verdict(output: str, nonce: str) -> tuple[dict[str, str], dict[str, float]] | None:
    """(outcomes, scores) on the harness's verdict line (the last line starting with `nonce`),
    or None when there is none or it is garbled."""
    for line in reversed(output.splitlines()):
        if line.startswith(nonce + " "):
            try:
                verdict = json.loads(line[len(nonce) + 1 :])
                tests, scores = verdict["tests"], verdict.get("scores", {})
                return (
                    {str(k): str(v) for k, v in tests.items()},
                    {str(k): float(v) for k, v in scores.items()},
                )
            except (ValueError, KeyError, TypeError, AttributeError):
                return None
    return None


def harness_input(grader: dict, nonce: str) -> str:
    """What the harness reads on stdin: the grader spec and the nonce."""
    return json.dumps({**grader, "nonce": nonce})


def run_grader(
    sandbox: Sandbox,
    grader: dict,
    limits: SandboxLimits | None = None,
    hidden_paths: tuple[str, ...] = (),
    ro_binds: dict[str, str] | None = None,
) -> tuple[dict[str, str], str, dict[str, float]]:
    """(outcome of every test the harness ran, output log, scores) for `grader` on the
    workspace."""
    nonce = secrets.token_hex(16)
    result = sandbox.run(
        _HARNESS_COMMAND,
        stdin=harness_input(grader, nonce),
        limits=limits,
        hidden_paths=hidden_paths,
        extra_ro_binds=ro_binds if sandbox.isolated else None,
    )
    outcomes, scores = parse_verdict(result.output, nonce) or ({}, {})
    return outcomes, result.output.replace(nonce, "<nonce>")[-2000:], scores


def run_replay(
    sandbox: Sandbox,
    root: Path,
    calls: dict,
    limits: SandboxLimits | None = None,
    hidden_paths: tuple[str, ...] = (),
) -> list[dict] | None:
    """The outcomes of replaying `calls` (a grader's `replay` entry: module, qualname, calls) on
    the grading tree at `root` without its tests and with an empty workspace (the replayed code
    could read the tests' expected values, or what the test run wrote, and return them), in a
    fresh command of the sandbox; None when the replay gave no well-formed reply (see
    `replay`)."""
    with repo_grading.replay_tree(root, replay.referenced_modules(calls)) as (tree, empty):
        command, stdin, marker = replay.command(tree, calls)
        binds = {**repo_grading.replay_binds(tree), str(empty): WORKSPACE_MOUNT}
        result = sandbox.run(
            command,
            stdin=stdin,
            limits=limits,
            hidden_paths=hidden_paths,
            extra_ro_binds=binds if sandbox.isolated else None,
        )
    try:
        return replay.parse(result.output, marker, len(calls["calls"]))
    except replay.ReplayError:
        return None


def grade(sandbox: Sandbox, task: Task, limits: SandboxLimits | None = None) -> GradeResult:
    """Runs the task's hidden tests against the sandbox's workspace (a fresh command); a
    repository task with recorded calls is rewarded by the share of replayed calls that match
    the original's outcomes, a test's calls counting only when it passed (`_replay_result`)."""
    replayed = None
    if task.grader["kind"] == "pytest":
        with repo_grading.grading_tree(task.files, sandbox.workspace, task.grader) as tree:
            root, candidates = tree
            spec = repo_grading.harness_spec(task.grader, task.graded_tests, root, candidates)
            binds = repo_grading.read_only_binds(root)
            outcomes, log, scores = run_grader(
                sandbox, spec, limits, task.grading_hidden_paths, binds
            )
            if "replay" in task.grader:
                replayed = run_replay(
                    sandbox, root, task.grader["replay"], limits, task.grading_hidden_paths
                )
    else:
        outcomes, log, scores = run_grader(sandbox, task.grader, limits, task.grading_hidden_paths)
    if "replay" in task.grader:
        return _replay_result(task, outcomes, log, scores, replayed)
    passed = sum(outcomes.get(test) == "pass" for test in task.graded_tests)
    total = len(task.graded_tests)
    return GradeResult(passed / total, passed, total, outcomes, log, scores)


def _replay_result(task: Task, outcomes, log, scores, replayed) -> GradeResult:
    """The reward of a replayed task: the calls of the tests that passed over all recorded
    calls, where a graded test passes when pytest passed it and every call it made matched.

    A test's calls count all together or not at all: pytest's verdict comes from the
    candidate's own process, and were a matched call to count alone, a body that only raises
    would collect every call expecting that exception from tests whose other calls it fails
    (given a forged verdict), where the test as a whole shows it does not do the job. And
    nothing counts until a test that checks a value (`replay.value_tests`) passes: a body that
    raises whatever it is given passes every test that only checks an input is refused."""
    calls = task.grader["replay"]
    total = len(calls["calls"])
    outcomes = dict(outcomes)
    made: dict[str, int] = {}
    for call, ok in zip(calls["calls"], replay.matches(calls, replayed)):
        made[call["test"]] = made.get(call["test"], 0) + 1
        if not ok and outcomes.get(call["test"]) == "pass":
            outcomes[call["test"]] = "replay_mismatch"
    matched = sum(n for test, n in made.items() if outcomes.get(test) == "pass")
    if not any(outcomes.get(test) == "pass" for test in replay.value_tests(calls)):
        matched = 0
    passed = sum(outcomes.get(test) == "pass" for test in task.graded_tests)
    scores = {**scores, "replay_matched": float(matched), "replay_calls": float(total)}
    if replayed is None:
        scores["replay_void"] = 1.0
    return GradeResult(matched / total, passed, len(task.graded_tests), outcomes, log, scores)


def grade_solution(
    task: Task, files: dict[str, str], limits: SandboxLimits | None = None, **sandbox_options
) -> GradeResult:
    """Grades `files` (relative path -> content, laid over the task's files; None deletes the
    task's file) in a fresh sandbox; e.g. `grade_solution(task, task.oracle_files).reward ==
    1.0`."""
    with _solution_sandbox(task, files, sandbox_options) as sandbox:
        return grade(sandbox, task, limits or GRADING_LIMITS)


def replay_solution(task: Task, files: dict[str, str], calls: dict, **sandbox_options):
    """The outcomes of replaying `calls` on `files` laid over the task's files (the factory
    records the original's this way, through the same sandbox and tree as a grading)."""
    with _solution_sandbox(task, files, sandbox_options) as sandbox:
        with repo_grading.grading_tree(task.files, sandbox.workspace, task.grader) as tree:
            return run_replay(sandbox, tree[0], calls, GRADING_LIMITS, task.grading_hidden_paths)


def visible_test_passes(task: Task, files: dict[str, str], **sandbox_options) -> bool | None:
    """Whether the task's visible test command exits 0 on `files` laid over the task's files,
    run as the `run_tests` tool runs it in a fresh sandbox (None: the task has no visible test)."""
    if task.visible_test_command is None:
        return None
    binds = repo_grading.test_binds() if task.grader["kind"] == "pytest" else None
    with _solution_sandbox(task, files, sandbox_options) as sandbox:
        return sandbox.run(task.visible_test_command, extra_ro_binds=binds).ok


def _solution_sandbox(task: Task, files: dict[str, str], sandbox_options: dict) -> Sandbox:
    """A fresh sandbox holding `files` laid over the task's files (None deletes a file)."""
    options = {"hidden_paths": task.hidden_paths, **sandbox_options}
    merged = {path: text for path, text in {**task.files, **files}.items() if text is not None}
    return Sandbox.from_files(merged, **options)
