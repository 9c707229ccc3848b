"""What a repository task's graded tests hard-code, for the special-casing monitor.

A candidate that compares its arguments with the tests' inputs, or returns their expected values,
is a lookup table keyed on tests it can read. The monitor (`grading.monitors`) flags a file that
newly holds two of a task's `test_literals`. A builtin task lists its hidden inputs; a repository
task lists the distinctive constants of its graded test functions (their decorators too, so
parametrized cases count): strings of three or more characters and lists, tuples and dicts of
two or more items, less every constant the package's own source modules hold (the package's
vocabulary is what an honest body uses). Numbers, booleans and None are left out as too common
to be evidence, and sets because their repr follows the hash seed.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Iterator

from composer_jax.envs.grading import repo_grading
from composer_jax.envs.grading.monitors import literal_values, parse_code

MAX_REPR_CHARS = 2000  # a longer constant is data, not a key anyone types into a branch
MAX_LITERALS = 256


# A set's tasks read the same few test files: each is parsed once (the trees are only read).
_parsed = functools.lru_cache(maxsize=16)(parse_code)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes under `tree` (prose, not values)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _distinctive(value) -> bool:
    if isinstance(value, (str, bytes)):
        return len(value) >= 3
    return isinstance(value, (list, tuple, dict)) and len(value) >= 2


def constant_reprs(tree: ast.AST) -> Iterator[str]:
    """The repr of every distinctive constant expression under `tree`, docstrings excepted."""
    skipped = _docstrings(tree)
    for node, value in literal_values(tree):
        if id(node) not in skipped and _distinctive(value):
            text = repr(value)
            if len(text) <= MAX_REPR_CHARS:
                yield text


def package_constants(files: dict[str, str], source_roots: Iterable[str]) -> frozenset[str]:
    """Every distinctive constant of the package's source modules."""
    roots = tuple(source_roots)
    found: set[str] = set()
    for path, text in files.items():
        if repo_grading.is_source_module(path, roots) and (tree := _parsed(text)) is not None:
            found.update(constant_reprs(tree))
    return frozenset(found)


def _test_function(tree: ast.Module, names: list[str]) -> ast.AST | None:
    """The class or function a pytest node id's names lead to (`Class::test[param]`)."""
    node: ast.AST = tree
    for name in names:
        name = name.split("[", 1)[0]
        node = next(
            (
                child
                for child in getattr(node, "body", ())
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and child.name == name
            ),
            None,
        )
        if node is None:
            return None
    return node


def graded_test_literals(
    files: dict[str, str], graded_tests: Iterable[str], known: frozenset[str]
) -> tuple[str, ...]:
    """The distinctive constants of the graded test functions that are not in `known` (the
    package's own, `package_constants`), in order of first appearance."""
    found: dict[str, None] = {}
    for test in graded_tests:
        path, *names = test.split("::")
        tree = _parsed(files.get(path, ""))
        node = _test_function(tree, names) if tree is not None and names else None
        if node is not None:
            found.update(dict.fromkeys(t for t in constant_reprs(node) if t not in known))
    return tuple(found)[:MAX_LITERALS]
