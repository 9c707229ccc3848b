"""Built-in repository tasks: the built-in functions inside a small package with its own tests.

Each task is a repository whose `helpers/<module>.py` holds a few documented functions of one
input kind (text, lists or numbers); one of them has had its body removed (signature and docstring
kept). The prompt names only the function and the file, so the agent has to find it and read its
docstring (what it must do, with an example), implement it, and may run the repository's visible
test; the hidden cases grade it. A tiny model can learn the whole tool-using loop on these (find,
read, plan, edit, test, report) in a CPU budget, which the report's real repositories are far
too large for. Splits are the built-in ones, by function: a held-out
function is never the target nor a neighbour in a training repository.
"""

from __future__ import annotations

import random

from composer_jax.envs.grading.task import Task, case_tests
from composer_jax.envs.tasks.builtin_tasks import (
    FunctionSpec,
    cases_grader,
    describe,
    draw_cases,
    function_name,
    input_kind_name,
    iter_builtin_tasks,
    random_spec,
    solution_lines,
    spec_of,
    split_of,
)

PACKAGE = "helpers"
MODULES = {"str": "text", "list": "lists", "int": "numbers"}
README = (
    "# helpers\n\nSmall functions on text, lists and numbers, one module each.\n"
    "Run a module's tests with `python3 -m tests.test_<module>`.\n"
)
STUB = "    raise NotImplementedError\n"
REPEATS_BEFORE_EXHAUSTED = 20_000


def _docstring(name: str, spec: FunctionSpec, example: tuple) -> str:
    value, result = example
    return (
        f'    """x is {input_kind_name(spec)}; {describe(spec)}; return the '
        f'result.\n\n    Example: {name}({value!r}) == {result!r}\n    """\n'
    )


def _function(name: str, spec: FunctionSpec, example: tuple, body: bool) -> str:
    code = "".join(f"    {line}\n" for line in solution_lines(spec)) if body else STUB
    return f"def {name}(x):\n{_docstring(name, spec, example)}{code}"


def _neighbours(spec: FunctionSpec, rng: random.Random, count: int, max_ops: int):
    """Other functions of the same input kind and split, with distinct names."""
    found, names = [], {function_name(spec)}
    while len(found) < count:
        other = random_spec(rng, max_ops)
        name = function_name(other)
        same = other.input_kind == spec.input_kind and split_of(other) == split_of(spec)
        if same and name not in names:
            names.add(name)
            found.append((name, other))
    return found


def make_repo_task(
    spec: FunctionSpec, rng: random.Random, task_id: str, neighbours: int, max_ops: int
) -> Task:
    """The repository task of `spec` (its example and hidden cases, the neighbours and their
    order drawn from `rng`)."""
    name = function_name(spec)
    example, cases = draw_cases(spec, rng)
    module = MODULES[spec.input_kind]
    path = f"{PACKAGE}/{module}.py"
    members = [(name, spec, example, True)]
    for other_name, other in _neighbours(spec, rng, neighbours, max_ops):
        members.append((other_name, other, draw_cases(other, rng)[0], False))
    rng.shuffle(members)

    def source(solved: bool) -> str:
        parts = [_function(n, s, e, body=solved or not target) for n, s, e, target in members]
        return f'"""{module.capitalize()} helpers."""\n\n\n' + "\n\n".join(parts)

    test_file = f"tests/test_{module}.py"
    value, result = example
    # As pytest's assertion rewriting would, a failure says what the call returned.
    call = f"{name}({value!r})"
    visible = (
        f"from {PACKAGE}.{module} import {name}\n\ngot = {call}\nexpected = {result!r}\n"
        f"assert got == expected, {call!r} + f' returned {{got!r}}, expected {{expected!r}}'\n"
        "print('ok')\n"
    )
    files = {
        "README.md": README,
        f"{PACKAGE}/__init__.py": '"""Small functions on text, lists and numbers."""\n',
        path: source(solved=False),
        "tests/__init__.py": "",
        test_file: visible,
    }
    prompt = (
        f"The body of `{name}` in {path} was removed; its docstring says what it does. "
        "Implement it and run the tests.\n"
    )
    return Task(
        task_id=task_id,
        prompt=prompt,
        files=files,
        grader=cases_grader(f"{PACKAGE}.{module}", name, cases),
        graded_tests=case_tests(len(cases)),
        visible_test_command=f"python3 -m tests.test_{module}",
        protected_paths=(test_file,),
        test_literals=tuple(repr(v) for v, _ in cases if len(repr(v)) >= 3),
        oracle_files={path: source(solved=True)},
        split=split_of(spec),
        family="builtin_repo",
        metadata={"function": spec.key(), "neighbours": neighbours, "max_ops": max_ops},
    )


def iter_repo_tasks(split: str = "train", seed: int = 0, max_ops: int = 1, neighbours: int = 2):
    """The repository tasks of one split in order, deterministic in `seed`; no target function
    twice, so it ends in an error once `REPEATS_BEFORE_EXHAUSTED` draws in a row bring only
    functions it already gave (few ops make few distinct functions)."""
    seen, repeats = set(), 0
    for task in iter_builtin_tasks(split, seed, max_ops):
        spec = spec_of(task)
        if spec.key() in seen:
            repeats += 1
            if repeats >= REPEATS_BEFORE_EXHAUSTED:
                raise ValueError(
                    f"builtin_repo:max_ops={max_ops} has only {len(seen)} distinct {split} "
                    "functions; ask for fewer tasks or allow more ops"
                )
            continue
        seen.add(spec.key())
        repeats = 0
        rng = random.Random(f"{seed}-{task.task_id}")
        yield make_repo_task(spec, rng, f"repo-{task.task_id}", neighbours, max_ops)


def repo_task_variant(task: Task, seed: int) -> Task:
    """A fresh instance: the same target function, new cases and neighbours, a new id."""
    meta = task.metadata
    return make_repo_task(
        spec_of(task),
        random.Random(f"{seed}-{task.task_id}"),
        f"{task.task_id}-v{seed}",
        int(meta["neighbours"]),
        int(meta["max_ops"]),
    )
