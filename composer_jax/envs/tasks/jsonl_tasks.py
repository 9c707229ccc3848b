"""Tasks from a JSONL file: one JSON object per line (blank lines and lines starting with '#'
are skipped). Errors name the file, the line and the field.

Fields (`FIELDS` is the machine-readable form):

    id                 str, required, unique in the file: [A-Za-z0-9_.:/-]+
    prompt             str, required: what the agent is asked to do
    files              {path: text}: the initial workspace (relative paths)
    grader             object, required; "kind" is one of
        cases          {"module": "solution", "function": "f",
                        "cases": [{"args": [...], "expected": ...}, ...]}   (JSON values)
        check          {"module", "function", "check": source defining check(candidate),
                        "prelude": source run before it (helpers the check calls)}
    visible_test_command  str: what the agent's run_tests tool runs
    protected_paths    [path, ...]: workspace files the agent must not change
    oracle_files       {path: text}: a reference solution (SFT data, oracle checks)
    split              str, default "train"
    test_literals      [str, ...]: reprs of hidden inputs (the special-casing monitor)
    group              str: what evaluation reports break results down by (e.g. "difficulty=hard")

A `test_command` whose printed output decides the grade, or test modules run beside the
candidate, are not supported: a process that runs the code under test can forge its own verdict
(see `harness`); a repository's tests grade through replay instead (`replay`). A repository task set (what
`launch.make_tasks` writes; format in `repo_task_sets`) reads through `jsonl:PATH` too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from composer_jax.envs.grading.task import Task, TaskError, case_tests, encode_value

_ID = re.compile(r"^[A-Za-z0-9_.:/-]+$")
FIELDS = {
    "id": (str, True),
    "prompt": (str, True),
    "files": (dict, False),
    "grader": (dict, True),
    "visible_test_command": (str, False),
    "protected_paths": (list, False),
    "oracle_files": (dict, False),
    "split": (str, False),
    "test_literals": (list, False),
    "group": (str, False),
}


class JsonlTaskError(ValueError):
    """A line of a task file that is not a valid task; the message names the line and field."""


def load_jsonl_tasks(path: str, family: str = "jsonl") -> list[Task]:
    """Every task of the file, in order."""
    file = Path(path)
    if not file.is_file():
        raise JsonlTaskError(f"{path}: no such task file")
    tasks, seen = [], {}
    with open(file, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except ValueError as error:
                raise JsonlTaskError(f"{where}: not JSON ({error})") from None
            task = parse_task(record, where, family)
            if task.task_id in seen:
                raise JsonlTaskError(
                    f"{where}: field 'id': {task.task_id!r} already used on line {seen[task.task_id]}"
                )
            seen[task.task_id] = number
            tasks.append(task)
    return tasks


def _fail(where: str, field: str, problem: str):
    raise JsonlTaskError(f"{where}: field {field!r}: {problem}")


def _text_map(value: dict, where: str, field: str) -> dict[str, str]:
    for key, text in value.items():
        if not isinstance(text, str) or not key or key.startswith("/") or ".." in key.split("/"):
            _fail(where, field, f"entry {key!r} must be a relative path mapped to text")
    return dict(value)


def _strings(value: list, where: str, field: str) -> tuple[str, ...]:
    if not all(isinstance(v, str) for v in value):
        _fail(where, field, "must be a list of strings")
    return tuple(value)


def parse_task(record: object, where: str, family: str = "jsonl") -> Task:
    """One record as a Task (JsonlTaskError naming `where` and the field when it is not one)."""
    if not isinstance(record, dict):
        raise JsonlTaskError(f"{where}: a task must be a JSON object")
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        _fail(where, unknown[0], f"unknown field (known: {', '.join(FIELDS)})")
    for name, (kind, required) in FIELDS.items():
        if name not in record:
            if required:
                _fail(where, name, "missing")
            continue
        if not isinstance(record[name], kind) or (
            kind is str and name != "visible_test_command" and not record[name]
        ):
            _fail(where, name, f"must be a non-empty {kind.__name__}")
    if not _ID.match(record["id"]):
        _fail(where, "id", f"{record['id']!r} must match {_ID.pattern}")
    files = _text_map(record.get("files", {}), where, "files")
    grader, graded = _grader(record, where)
    try:
        return Task(
            task_id=record["id"],
            prompt=record["prompt"],
            files=files,
            grader=grader,
            graded_tests=graded,
            visible_test_command=record.get("visible_test_command"),
            protected_paths=_strings(record.get("protected_paths", []), where, "protected_paths"),
            test_literals=_strings(record.get("test_literals", []), where, "test_literals"),
            oracle_files=_text_map(record.get("oracle_files", {}), where, "oracle_files"),
            split=record.get("split", "train"),
            family=family,
            group=record.get("group", ""),
        )
    except TaskError as error:
        raise JsonlTaskError(f"{where}: {error}") from None


def _grader(record: dict, where: str) -> tuple[dict, tuple[str, ...]]:
    spec = dict(record["grader"])
    kind = spec.pop("kind", None)
    if kind == "cases":
        for key in ("module", "function"):
            if not isinstance(spec.get(key), str):
                _fail(where, f"grader.{key}", "must be a string")
        cases = spec.get("cases")
        if not isinstance(cases, list) or not cases:
            _fail(where, "grader.cases", "must be a non-empty list")
        encoded = []
        for i, case in enumerate(cases):
            if not isinstance(case, dict) or set(case) != {"args", "expected"}:
                _fail(where, f"grader.cases[{i}]", 'must be {"args": [...], "expected": ...}')
            if not isinstance(case["args"], list):
                _fail(where, f"grader.cases[{i}].args", "must be a list")
            encoded.append(
                [[encode_value(a) for a in case["args"]], encode_value(case["expected"])]
            )
        grader = {
            "kind": "cases",
            "module": spec["module"],
            "function": spec["function"],
            "cases": encoded,
        }
        return grader, case_tests(len(encoded))
    if kind == "check":
        for key in ("module", "function", "check"):
            if not isinstance(spec.get(key), str):
                _fail(where, f"grader.{key}", "must be a string")
        grader = {
            "kind": "check",
            "module": spec["module"],
            "function": spec["function"],
            "check": spec["check"],
            "prelude": spec.get("prelude", ""),
        }
        return grader, ("check",)
    _fail(
        where,
        "grader.kind",
        "must be cases or check (a repository graded by its own tests: launch.make_tasks)",
    )
