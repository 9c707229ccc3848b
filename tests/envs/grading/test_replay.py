"""Replay grading on a package it has never seen: the factory records the graded tests' calls to
the deleted function as plain data, the original's outcomes are the expected ones, and only a
candidate that produces the same values (exact types, in-place mutations, iterator items,
exception types) is rewarded; the replay's reply is decoded strictly."""

import dataclasses
import json
import os
import textwrap

import pytest

from composer_jax.envs.grading import harness, replay, repo_grading
from composer_jax.envs.grading.task import GRADING_LIMITS, grade_solution
from composer_jax.envs.sandbox import Sandbox
from composer_jax.envs.tasks import repo_factory
from composer_jax.envs.tasks.repo_task_sets import read_task_set, shipped_sets
from tests.helpers import ISOLATING

_CORE = '''
_missing = object()


def scale(values, factor=2, *, offset=0):
    """Each value times factor, plus offset."""
    return [v * factor + offset for v in values]


def first(seq, default=_missing):
    for item in seq:
        return item
    if default is _missing:
        raise ValueError("empty")
    return default


def depth(tree):
    if not isinstance(tree, list):
        return 0
    return 1 + max((depth(t) for t in tree), default=0)


def append_twice(items, value):
    items.append(value)
    items.append(value)


def evens(n):
    for i in range(n):
        if i % 2 == 0:
            yield i


def apply_each(func, values):
    return [func(v) for v in values]
'''
_TESTS = """
import pytest

from tinypkg.core import append_twice, apply_each, depth, evens, first, scale

FACTOR = 2


def double(x):
    return FACTOR * x


def test_scale():
    assert scale([1, 2]) == [2, 4]
    assert scale([1], factor=3, offset=1) == [4]


def test_first():
    assert first([5, 6]) == 5
    assert first([], default=None) is None
    assert first(iter([7])) == 7
    with pytest.raises(ValueError):
        first([])


def test_depth():
    assert depth([[1], [[2]]]) == 3


def test_append_twice():
    items = [1]
    append_twice(items, 2)
    assert items == [1, 2, 2]


def test_evens():
    assert list(evens(5)) == [0, 2, 4]


def test_apply_each():
    assert apply_each(double, [1, 2]) == [2, 4]
"""


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinypkg")
    (root / "tinypkg").mkdir()
    (root / "tinypkg" / "__init__.py").write_text("")
    (root / "tinypkg" / "core.py").write_text(textwrap.dedent(_CORE))
    (root / "tests").mkdir()
    (root / "tests" / "test_core.py").write_text(textwrap.dedent(_TESTS))
    return repo_factory.find_layout(root, "tinypkg", "0", str(root))


def task_of(repository, function):
    path = "tinypkg/core.py"
    deletion = next(
        d for d in repo_factory.deletable_functions(repository.files[path]) if d[0] == function
    )
    test = f"tests/test_core.py::test_{function}"
    return repo_factory.make_task(repository, path, deletion, [test], "train")


def decoded_calls(task):
    recorded, opaque = repo_factory.record_calls(task)
    (test,) = task.graded_tests
    return [tuple(harness.decode(call)) for call in recorded[test]], opaque[test]


def test_recorded_calls_are_the_arguments_as_plain_data(repository):
    # Defaults left out (a sentinel object is not plain data); a parameter that can go by
    # position does, keyword-only ones by keyword.
    assert decoded_calls(task_of(repository, "scale")) == (
        [([[1, 2]], {}), ([[1], 3], {"offset": 1})],
        0,
    )
    # An iterator argument is not plain data: counted, not kept.
    assert decoded_calls(task_of(repository, "first")) == (
        [([[5, 6]], {}), ([[], None], {}), ([[]], {})],
        1,
    )
    # Only the outermost call of a recursion; arguments as they were before the call.
    assert decoded_calls(task_of(repository, "depth")) == ([([[[1], [[2]]]], {})], 0)
    assert decoded_calls(task_of(repository, "append_twice")) == ([([[1], 2], {})], 0)


@pytest.mark.parametrize(
    "function,wrong",
    [
        ("scale", "return [v * factor + offset + 0.0 for v in values]"),  # floats, not ints
        ("first", "raise KeyError(seq)"),  # the wrong exception type
        ("append_twice", "items.append(value)"),  # the wrong in-place mutation
        ("evens", "return iter(range(0, n + 2, 2))"),  # one item too many
    ],
)
def test_replay_rewards_the_original_values_only(repository, function, wrong):
    task, why = repo_factory.attach_replay(task_of(repository, function), backend="auto")
    assert why == "kept" and task.grader["replay"]["calls"]
    path = task.metadata["path"]
    assert grade_solution(task, task.oracle_files).reward == 1.0
    assert grade_solution(task, {}).reward == 0.0
    body = task.files[path].replace("raise NotImplementedError", wrong, 1)
    assert grade_solution(task, {path: body}).reward < 1.0


def test_a_task_whose_tests_make_no_replayable_call_is_suite_only(repository):
    task = task_of(repository, "first")
    only_iterators = task.files["tests/test_core.py"].replace(
        "def test_first():", "def test_first():\n    assert first(iter([1])) == 1\n    return\n"
    )
    task = dataclasses.replace(task, files={**task.files, "tests/test_core.py": only_iterators})
    unchanged, why = repo_factory.attach_replay(task, backend="auto")
    assert why == "no call with plain-data arguments" and "replay" not in unchanged.grader


def test_a_task_whose_graded_tests_check_no_value_is_dropped(repository):
    """The graded test only checks that an empty input raises: a body that raises passes it."""
    task = task_of(repository, "first")
    only_raises = task.files["tests/test_core.py"].replace(
        "def test_first():",
        "def test_first():\n    with pytest.raises(ValueError):\n        first([])\n    return\n",
    )
    task = dataclasses.replace(task, files={**task.files, "tests/test_core.py": only_raises})
    dropped, why = repo_factory.with_verified_replay(task, backend="auto")
    assert dropped is None and why.startswith("no graded test checks a value")


def _outcome(result, after=None):
    return {"result": result, "args_after": after}


def test_the_reply_is_decoded_strictly():
    marker = "m" * 32
    good = _outcome(["value", ["int", 1]])
    assert replay.parse(f"noise\n{marker} " + json.dumps({"outcomes": [good]}), marker, 1)
    bad_replies = [
        "",  # nothing
        f"{marker} not json",
        f"{marker} " + json.dumps({"outcomes": [good, good]}),  # the wrong count
        f"{marker} " + json.dumps({"outcomes": [_outcome(["pickle", "gASVAA=="])]}),
        f"{marker} " + json.dumps({"outcomes": [_outcome(["value", ["object", "x"]])]}),
        f"{marker} " + json.dumps({"outcomes": [{"result": ["value", ["int", 1]]}]}),
        f"{marker} " + json.dumps({"error": "ImportError: no module"}),
    ]
    for reply in bad_replies:
        with pytest.raises(replay.ReplayError):
            replay.parse(reply, marker, 1)


def test_outcomes_compare_with_exact_types():
    def value(v):
        return _outcome(["value", harness.encode(v)])

    assert replay.same(value({1, 2, 3}), value({3, 2, 1}))  # a set's order does not count
    assert not replay.same(value(True), value(1))
    assert not replay.same(value(2.0), value(2))
    assert not replay.same(value((1, 2)), value([1, 2]))
    assert replay.same(value(float("nan")), value(float("nan")))
    # Inside sets and dict keys too, where Python's == takes 1, 1.0 and True for each other.
    assert not replay.same(value({1.0, 2.0}), value({1, 2}))
    assert not replay.same(value({True}), value({1}))
    assert not replay.same(value(frozenset({(1.0, 2)})), value(frozenset({(1, 2)})))
    assert not replay.same(value({1: "a"}), value({True: "a"}))
    assert not replay.same(value({"k": 1}), value({"k": 1.0}))
    assert replay.same(value({(1, "b"): {2, 3}, "a": [1.5]}), value({"a": [1.5], (1, "b"): {3, 2}}))
    assert not replay.same(
        _outcome(["raise", "builtins.KeyError"]), _outcome(["raise", "builtins.ValueError"])
    )
    assert not replay.same(
        _outcome(["iter", [["int", 0]], "more"]), _outcome(["iter", [["int", 0]], "end"])
    )


# ------------------------------------------------------------ the expected outcomes stay out
# A candidate that searches every readable file (gzip members opened) and its own process's
# memory for the expected outcomes while the replay imports it. The needle is split in two
# halves that this program holds apart (a match is one half directly followed by the other), so
# the search never finds its own copy; a control needle that the module does hold contiguously
# shows the memory search works, and one planted in the workspace shows the file search does.
_SEARCH = r"""
import gzip, json, os, sys
_HALVES = {"expected": (EXPECTED_A, EXPECTED_B), "control": (b"cj-memory-cont", b"rol-needle-7q")}
_PLANTED = (b"cj-planted-file-", b"needle-3k")
_CONTIGUOUS = b"cj-memory-control-needle-7q"  # the memory search's control


def _joined(data, halves):
    first, second = halves
    start = data.find(first)
    while start >= 0:
        if data[start + len(first): start + len(first) + len(second)] == second:
            return True
        start = data.find(first, start + 1)
    return False


def _memory(found):
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
        regions = [line.split() for line in maps]
        for region in regions:
            low, high = (int(x, 16) for x in region[0].split("-"))
            if "r" not in region[1] or high - low > (256 << 20):
                continue
            try:
                mem.seek(low)
                data = mem.read(high - low)
            except (OSError, ValueError, OverflowError):
                continue
            for name, halves in _HALVES.items():
                if _joined(data, halves):
                    found.add(f"memory:{name}")


def _files(found):
    for top, dirs, files in os.walk("/"):
        if top.startswith(("/proc", "/sys", "/dev")):
            dirs[:] = []
            continue
        for name in files:
            path = os.path.join(top, name)
            try:
                with open(path, "rb") as f:
                    data = f.read(32 << 20)
                if path.endswith(".gz"):
                    data += gzip.decompress(data)
            except (OSError, EOFError, ValueError):
                continue
            if _joined(data, _HALVES["expected"]):
                found.add(f"file:{path}")
            if _joined(data, _PLANTED):
                found.add("file:planted")


_found = set()
_memory(_found)
_files(_found)
print("SEARCHED", json.dumps(sorted(_found)), file=sys.stderr)
"""


@pytest.mark.parametrize("backend", ISOLATING)
def test_the_expected_outcomes_cannot_be_read_from_inside_the_sandbox(backend):
    shipped = shipped_sets()["toolz"]
    task = next(t for t in read_task_set(shipped) if "replay" in t.grader)
    needle = json.dumps(task.grader["replay"]["expected"][0]).encode()
    half = len(needle) // 2
    search = _SEARCH.replace("EXPECTED_A", repr(needle[:half])).replace(
        "EXPECTED_B", repr(needle[half:])
    )
    path = task.metadata["path"]
    files = {
        **task.files,
        path: task.files[path] + search,
        "notes/planted.txt": "cj-planted-file-needle-3k",
    }
    with Sandbox.from_files(files, backend=backend, hidden_paths=task.hidden_paths) as box:
        with repo_grading.grading_tree(task.files, box.workspace, task.grader) as tree:
            command, stdin, _ = replay.command(tree[0], task.grader["replay"])
            limits = dataclasses.replace(GRADING_LIMITS, wall_seconds=300, cpu_seconds=300)
            result = box.run(
                command,
                stdin=stdin,
                limits=limits,
                hidden_paths=task.grading_hidden_paths,
                extra_ro_binds=repo_grading.read_only_binds(tree[0]),
            )
    lines = [line for line in result.output.splitlines() if line.startswith("SEARCHED ")]
    assert lines, result.output[-2000:]
    found = set(json.loads(lines[-1].split(" ", 1)[1]))
    assert found == {"memory:control", "file:planted"}, found


_READER = '''def NAME(PARAMS):
    """Nothing of the task: the answer a test expects, read from a test module at run time (the
    assert that calls NAME with this call's last argument)."""
    import ast
    import os

    for top, _, names in os.walk(WHERE):
        for name in names:
            if not (name.startswith("test_") and name.endswith(".py")):
                continue
            with open(os.path.join(top, name)) as handle:
                tree = ast.parse(handle.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call):
                    call = node.left
                    if getattr(call.func, "id", "") == "NAME" and len(call.args) == ARITY:
                        try:
                            if ast.literal_eval(call.args[-1]) == LAST:
                                return ast.literal_eval(node.comparators[0])
                        except ValueError:
                            pass
    return None  # never the answer
'''


def _reading(task, name: str, params: tuple[str, ...], where: str = "os.getcwd()") -> dict:
    """The task's module with `name` a `_READER` of the test modules under `where`."""
    path = task.metadata["path"]
    stub = task.files[path]
    start = stub.index(f"def {name}(")
    end = stub.index("raise NotImplementedError", start) + len("raise NotImplementedError\n")
    fields = {"NAME": name, "PARAMS": ", ".join(params), "ARITY": str(len(params))}
    reader = _READER
    for field, value in {**fields, "LAST": params[-1], "WHERE": where}.items():
        reader = reader.replace(field, value)
    return {path: stub[:start] + reader + stub[end:]}


@pytest.mark.parametrize("backend", ISOLATING)
@pytest.mark.parametrize("where", ["os.getcwd()", "'/workspace'"])
def test_a_function_that_reads_the_tests_expected_values_at_run_time_scores_0(backend, where):
    """The tests must be there for pytest, and that run passes; the replay, which decides the
    reward, runs where no test module is (the grading tree without them, an empty workspace)."""
    task = next(
        t for t in read_task_set(shipped_sets()["toolz"]) if t.task_id.endswith(":frequencies")
    )
    result = grade_solution(task, _reading(task, "frequencies", ("seq",), where), backend=backend)
    assert result.reward == 0.0, (result.outcomes, result.scores)
    assert result.scores["replay_calls"] > 0 and result.scores["replay_matched"] == 0


_BYTECODE_READER = '''def NAME(*args, **kwargs):
    """Nothing of the task: the value a test compares this call's result with, learnt by running
    the tests' compiled modules found under WHERE, with NAME swapped for a probe."""
    import marshal
    import os
    import sys
    import unittest

    learnt = []

    class Answer:
        def __init__(self, call):
            self.call = call

        def __eq__(self, other):
            learnt.append((self.call, other))
            return True

    package = sys.modules["PACKAGE"]
    original = package.NAME
    package.NAME = lambda *a, **k: Answer((a, k))
    try:
        for top, _, names in os.walk(WHERE):
            for name in names:
                if not (name.startswith("test_") and name.endswith(".pyc")):
                    continue
                module = {"__name__": "read_" + name.split(".")[0]}
                with open(os.path.join(top, name), "rb") as handle:
                    try:
                        exec(marshal.loads(handle.read()[16:]), module)
                    except Exception:
                        continue
                for case in module.values():
                    if isinstance(case, type) and issubclass(case, unittest.TestCase):
                        for test, function in vars(case).items():
                            code = getattr(function, "__code__", None)
                            if test.startswith("test") and code and "NAME" in code.co_names:
                                try:
                                    getattr(case(test), test)()
                                except Exception:
                                    pass
    finally:
        package.NAME = original
    return next((value for call, value in learnt if call == (args, kwargs)), None)
'''


@pytest.mark.parametrize("backend", ISOLATING)
def test_a_function_that_runs_the_tests_compiled_modules_scores_0(backend):
    """pytest caches the tests' bytecode (assertions rewritten, expected values in it) outside
    the source roots; the replay, which decides the reward, must not see that cache (with it
    bound, this reader scored 1.0)."""
    task = next(
        t
        for t in read_task_set(shipped_sets()["more_itertools"])
        if t.task_id.endswith(":dotproduct")
    )
    path = task.metadata["path"]
    stub = task.files[path]
    start = stub.index("def dotproduct(")
    end = stub.index("raise NotImplementedError", start) + len("raise NotImplementedError\n")
    where = os.path.dirname(repo_grading.pycache_dir())  # the host's temporary folder
    reader = _BYTECODE_READER.replace("NAME", "dotproduct").replace("PACKAGE", "more_itertools")
    reader = reader.replace("WHERE", repr(where))
    result = grade_solution(task, {path: stub[:start] + reader + stub[end:]}, backend=backend)
    # pytest passed it (the cache is there for pytest): only the replay, which ran and replied,
    # stands between the reader and the reward.
    assert set(result.outcomes.values()) == {"replay_mismatch"}, (result.outcomes, result.scores)
    assert result.reward == 0.0 and result.scores["replay_matched"] == 0
    assert "replay_void" not in result.scores
    assert grade_solution(task, task.oracle_files, backend=backend).reward == 1.0


def test_a_test_module_a_recorded_input_names_is_kept_without_its_tests():
    source = textwrap.dedent(_TESTS).encode()
    kept = repo_grading.without_tests(source, {"double"}).decode()
    assert "assert" not in kept and "def test_" not in kept
    assert "FACTOR = 2\n\ndef double(x):\n    return FACTOR * x" in kept
    # The module state a helper relies on stays: registries filled by decorators or statements,
    # imports, blocks (emptied ones get a `pass`); a test a helper calls stays too.
    helpers = textwrap.dedent(
        """
        import sys
        import unittest
        REGISTRY = {}
        def register(f):
            REGISTRY[f.__name__] = f
            return f
        @register
        def inc(x):
            return x + 1
        REGISTRY["twice"] = lambda x: 2 * x
        assert inc(1) == 2
        if sys.version_info >= (3,):
            def test_inside():
                assert inc(2) == 3
        class TestThing:
            def test_a(self):
                assert inc(0) == 1
        class Cases(unittest.TestCase):
            pass
        def test_used():
            return 5
        def helper(x):
            return REGISTRY["inc"](x) + REGISTRY["twice"](x) + test_used()
        """
    ).encode()
    kept = repo_grading.without_tests(helpers, {"helper"}).decode()
    assert "TestThing" not in kept and "Cases" not in kept and "test_inside" not in kept
    assert "assert" not in kept and "if sys.version_info >= (3,):\n    pass" in kept
    module = {}
    exec(kept, module)
    assert module["helper"](3) == 4 + 6 + 5


def test_a_function_that_reads_the_test_module_of_a_named_helper_scores_0(repository):
    """A recorded input names a test module's helper (`double`), so the replay imports that
    module: it holds the helper, never the tests and their expected values."""
    task, why = repo_factory.attach_replay(task_of(repository, "apply_each"), backend="auto")
    assert why == "kept"
    (names,) = replay.referenced_modules(task.grader["replay"]).values()
    assert names == {"double"}
    assert grade_solution(task, task.oracle_files).reward == 1.0
    result = grade_solution(task, _reading(task, "apply_each", ("func", "values")))
    assert result.scores["replay_calls"] == 1 and result.scores["replay_matched"] == 0
    assert result.reward == 0.0
