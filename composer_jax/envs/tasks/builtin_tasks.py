"""The built-in task family: tiny generated Python functions with hidden tests.

A task chains one to three parameterised transforms of a string, a list of ints or an int
(`reverse it, then replace 'a' with 'x'`). Prompts and solutions are a few hundred bytes so a small
byte-level model can learn them after a short SFT, and there are many thousands of distinct
functions. Everything is a pure function of the seed; the split is by a hash of the function's
spec, so a held-out function never appears in training under another seed.
"""

import dataclasses
import hashlib
import itertools
import json
import random
import string

from composer_jax.envs.grading.task import Task, case_tests, encode_value

SOLUTION_FILE = "solution.py"
VISIBLE_TEST_FILE = "test_solution.py"
HELD_OUT_PERCENT = 10
_NUM_HIDDEN_CASES = 6
_LETTERS = "abcdefghij"


@dataclasses.dataclass(frozen=True)
class _Op:
    """One transform: its kind (input -> output type), how it reads and how it is coded."""

    kind: str  # "str", "list", "int", or "str->int" / "list->int" for reductions
    text: str  # description, formatted with the parameters
    code: str  # a statement on `x`, formatted with the parameters
    params: tuple = ()  # per-parameter choices
    slug: str = ""  # its part of a function name (`function_name`), formatted like `text`


_OPS = (
    _Op("str", "reverse it", "x = x[::-1]", slug="reverse"),
    _Op("str", "make it upper case", "x = x.upper()", slug="upper"),
    _Op("str", "swap the case of each letter", "x = x.swapcase()", slug="swapcase"),
    _Op(
        "str",
        "replace {0!r} with {1!r}",
        "x = x.replace({0!r}, {1!r})",
        (_LETTERS, "xyz-"),
        slug="replace_{0}{1}",
    ),
    _Op(
        "str",
        "repeat each character {0} times",
        "x = ''.join(c * {0} for c in x)",
        ((2, 3),),
        slug="repeat{0}",
    ),
    _Op("str", "keep every {0}th character", "x = x[::{0}]", ((2, 3),), slug="every{0}"),
    _Op("str", "append {0!r}", "x = x + {0!r}", (("!", "ok", "zz", "-end"),), slug="append_{0}"),
    _Op("str", "remove every {0!r}", "x = x.replace({0!r}, '')", (_LETTERS,), slug="remove_{0}"),
    _Op("str", "sort its characters", "x = ''.join(sorted(x))", slug="sort"),
    _Op(
        "str->int",
        "count the {0!r} characters",
        "x = x.count({0!r})",
        (_LETTERS,),
        slug="count_{0}",
    ),
    _Op("str->int", "take its length", "x = len(x)", slug="length"),
    _Op(
        "list",
        "multiply each item by {0}",
        "x = [v * {0} for v in x]",
        ((2, 3, -1, 10),),
        slug="scale{0}",
    ),
    _Op(
        "list",
        "add {0} to each item",
        "x = [v + {0} for v in x]",
        ((1, 2, 5, -3),),
        slug="shift{0}",
    ),
    _Op(
        "list",
        "keep items greater than {0}",
        "x = [v for v in x if v > {0}]",
        ((0, 2, 5),),
        slug="keep_over{0}",
    ),
    _Op("list", "keep the even items", "x = [v for v in x if v % 2 == 0]", slug="keep_even"),
    _Op("list", "reverse it", "x = x[::-1]", slug="reverse"),
    _Op("list", "sort it", "x = sorted(x)", slug="sort"),
    _Op("list", "take the first {0} items", "x = x[:{0}]", ((1, 2, 3),), slug="head{0}"),
    # A name is never a builtin's: `def sum(x): x = sum(x)` would call itself.
    _Op("list->int", "take the sum", "x = sum(x)", slug="total"),
    _Op("list->int", "take the length", "x = len(x)", slug="length"),
    _Op("int", "multiply it by {0}", "x = x * {0}", ((2, 3, 7, -1),), slug="times{0}"),
    _Op("int", "add {0}", "x = x + {0}", ((1, 4, 10, -5),), slug="plus{0}"),
    _Op("int", "take it modulo {0}", "x = x % {0}", ((3, 5, 7),), slug="mod{0}"),
    _Op("int", "integer-divide it by {0}", "x = x // {0}", ((2, 3, 10),), slug="div{0}"),
    _Op("int", "square it", "x = x * x", slug="square"),
    _Op("int", "take its absolute value", "x = abs(x)", slug="absolute"),
)
_INPUT_NAMES = {"str": "a string", "list": "a list of ints", "int": "an int"}


@dataclasses.dataclass(frozen=True)
class FunctionSpec:
    """The function to write: input type and its chain of (op index, parameters)."""

    input_kind: str
    steps: tuple[tuple[int, tuple], ...]

    def key(self) -> str:
        return json.dumps([self.input_kind, [list(s) for s in self.steps]])


MAX_OPS = 3


def random_spec(rng: random.Random, max_ops: int = MAX_OPS) -> FunctionSpec:
    input_kind = rng.choice(("str", "list", "int"))
    steps = []
    kind = input_kind
    for _ in range(rng.randint(1, MAX_OPS))[:max_ops]:
        choices = [i for i, op in enumerate(_OPS) if op.kind.split("->")[0] == kind]
        index = rng.choice(choices)
        op = _OPS[index]
        steps.append((index, tuple(rng.choice(options) for options in op.params)))
        if "->" in op.kind:
            break
    return FunctionSpec(input_kind, tuple(steps))


def describe(spec: FunctionSpec) -> str:
    parts = [_OPS[i].text.format(*params) for i, params in spec.steps]
    return ", then ".join(parts)


def solution_lines(spec: FunctionSpec) -> list[str]:
    """The oracle solution's body: one statement per transform, then `return x`."""
    return [_OPS[i].code.format(*params) for i, params in spec.steps] + ["return x"]


def solution_source(spec: FunctionSpec) -> str:
    """The oracle solution."""
    return "def f(x):\n" + "".join(f"    {line}\n" for line in solution_lines(spec))


def _name_part(value) -> str:
    if isinstance(value, int):
        return str(value) if value >= 0 else f"neg{-value}"
    words = {"!": "bang", "-": "dash"}
    return "".join(words.get(c, c) for c in value)


def function_name(spec: FunctionSpec) -> str:
    """A name that says what the function does, one part per transform with its parameters
    (e.g. replace_ax_upper, scale3_total): distinct functions get distinct names."""
    parts = [_OPS[i].slug.format(*(_name_part(p) for p in params)) for i, params in spec.steps]
    return "_".join(parts)


def input_kind_name(spec: FunctionSpec) -> str:
    """ "a string", "a list of ints" or "an int"."""
    return _INPUT_NAMES[spec.input_kind]


def evaluate(spec: FunctionSpec, value):
    namespace: dict = {}
    exec(solution_source(spec), namespace)  # noqa: S102 - our own generated code
    return namespace["f"](value)


def random_input(rng: random.Random, kind: str):
    if kind == "str":
        alphabet = _LETTERS + string.ascii_uppercase[:4]
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(3, 9)))
    if kind == "list":
        return [rng.randint(-5, 9) for _ in range(rng.randint(2, 6))]
    return rng.randint(-20, 60)


def split_of(spec: FunctionSpec) -> str:
    digest = int(hashlib.sha256(spec.key().encode()).hexdigest()[:8], 16)
    return "held_out" if digest % 100 < HELD_OUT_PERCENT else "train"


def make_task(seed: int, max_ops: int = MAX_OPS) -> Task:
    """The task of one seed (deterministic). `max_ops` < 3 truncates the chain of transforms
    (an easier family: the same seed gives the first `max_ops` transforms of the full task)."""
    rng = random.Random(seed)
    spec = random_spec(rng, max_ops)
    return _instance(spec, rng, f"builtin-{seed}")


def spec_of(task: Task) -> FunctionSpec:
    """The function a built-in task (or a task made from one) asks for."""
    kind, steps = json.loads(task.metadata["function"])
    return FunctionSpec(kind, tuple((i, tuple(params)) for i, params in steps))


def task_variant(task: Task, seed: int) -> Task:
    """A fresh instance of a built-in task: the same function, other inputs (a new task id)."""
    return _instance(spec_of(task), random.Random(seed), f"{task.task_id}-v{seed}")


def draw_cases(spec: FunctionSpec, rng: random.Random) -> tuple[tuple, list[tuple]]:
    """(the visible example (input, output), the hidden cases [(input, output)]): distinct
    inputs drawn from `rng`."""
    inputs: list = []
    while len(inputs) < _NUM_HIDDEN_CASES + 1:
        value = random_input(rng, spec.input_kind)
        if value not in inputs:
            inputs.append(value)
    cases = [(value, evaluate(spec, value)) for value in inputs]
    return cases[0], cases[1:]


def cases_grader(module: str, function: str, cases: list[tuple]) -> dict:
    return {
        "kind": "cases",
        "module": module,
        "function": function,
        "cases": [[[encode_value(arg)], encode_value(want)] for arg, want in cases],
    }


def _instance(spec: FunctionSpec, rng: random.Random, task_id: str) -> Task:
    """The task of `spec` with inputs drawn from `rng`."""
    (example, example_out), cases = draw_cases(spec, rng)
    prompt = (
        f"Write f(x) in {SOLUTION_FILE}: x is {input_kind_name(spec)}; "
        f"{describe(spec)}; return the result.\nExample: f({example!r}) == {example_out!r}\n"
    )
    visible = f"from solution import f\nassert f({example!r}) == {example_out!r}\nprint('ok')\n"
    return Task(
        task_id=task_id,
        prompt=prompt,
        files={
            SOLUTION_FILE: "def f(x):\n    raise NotImplementedError\n",
            VISIBLE_TEST_FILE: visible,
        },
        grader=cases_grader(SOLUTION_FILE.removesuffix(".py"), "f", cases),
        graded_tests=case_tests(len(cases)),
        visible_test_command=f"python3 {VISIBLE_TEST_FILE}",
        protected_paths=(VISIBLE_TEST_FILE,),
        test_literals=tuple(repr(v) for v, _ in cases if len(repr(v)) >= 3),
        oracle_files={SOLUTION_FILE: solution_source(spec)},
        split=split_of(spec),
        family="builtin",
        metadata={"function": spec.key()},
    )


def iter_builtin_tasks(split: str = "train", seed: int = 0, max_ops: int = MAX_OPS):
    """The tasks of one split ("train" or "held_out") in order, endless, deterministic in
    `seed`, chaining at most `max_ops` transforms; no prompt twice."""
    if split not in ("train", "held_out"):
        raise ValueError(f"split must be 'train' or 'held_out', got {split!r}")
    if not 1 <= max_ops <= MAX_OPS:
        raise ValueError(f"max_ops must lie in [1, {MAX_OPS}], got {max_ops}")
    seen = set()
    task_seed = seed * 1_000_003
    while True:
        task = make_task(task_seed, max_ops)
        task_seed += 1
        if task.split == split and task.prompt not in seen:
            seen.add(task.prompt)
            yield task


def builtin_tasks(
    count: int, split: str = "train", seed: int = 0, max_ops: int = MAX_OPS
) -> list[Task]:
    """The first `count` tasks of `iter_builtin_tasks`."""
    return list(itertools.islice(iter_builtin_tasks(split, seed, max_ops), count))
