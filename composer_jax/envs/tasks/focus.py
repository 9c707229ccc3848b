"""A task's target: the function an episode has to write, and the editor tab that shows it.

The target is the file the reference solution changes and the function the grader names (a
repository task's deleted function). The open tab is what an editor's harness gives the agent at
the start: the target function's lines as they stand in the workspace (its signature, docstring
and stub), the same text a `read_file` of those lines returns. It tells nothing the prompt does not
name already (the file and the function), only saves the agent finding and reading it.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator

from composer_jax.envs.grading.task import Task


@dataclasses.dataclass(frozen=True)
class Target:
    """The function an episode has to write: its file and qualified name."""

    path: str
    name: str


def target_of(task: Task) -> Target | None:
    """The file the reference solution changes and the function the grader names (None for a
    task without both)."""
    changed = sorted(p for p, text in task.oracle_files.items() if task.files.get(p) != text)
    deletion = task.metadata.get("deletion")
    name = task.grader.get("function") or (deletion[0] if deletion else None)
    if not changed or not isinstance(name, str):
        return None
    return Target(changed[0], name)


def definitions(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """Every function and class of a module with its qualified name ("Class.method"), each
    container before what it holds."""
    pending = [(node, "") for node in tree.body]
    while pending:
        node, owner = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = owner + node.name
            yield name, node
            pending += [(child, name + ".") for child in node.body]


def find_function(source: str | None, qualname: str) -> ast.FunctionDef | None:
    """The definition of `qualname` (e.g. "Class.method") in `source`, or None (also when the
    source does not parse)."""
    try:
        tree = ast.parse(source or "")
    except (SyntaxError, ValueError):
        return None
    return next(
        (
            node
            for name, node in definitions(tree)
            if name == qualname and not isinstance(node, ast.ClassDef)
        ),
        None,
    )


def _tab(
    task: Task, max_lines: int, files: dict[str, str] | None = None
) -> tuple[str, int, int, int] | None:
    """(path, first line, last line shown, last line of the function) of the open tab, in
    `files` (default: the task's)."""
    target = target_of(task)
    if max_lines <= 0 or target is None:
        return None
    node = find_function((task.files if files is None else files).get(target.path), target.name)
    if node is None:
        return None
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    end = node.end_lineno or node.lineno
    return target.path, first, min(end, first + max_lines - 1), end


def tab_span(task: Task, max_lines: int) -> tuple[str, int, int] | None:
    """(path, first line, last line) of the open tab: the target function's lines in the
    workspace, at most `max_lines` of them from its first (decorators included); None without a
    target in the workspace or with `max_lines` 0."""
    tab = _tab(task, max_lines)
    return None if tab is None else tab[:3]


def tab_shows_target(task: Task, max_lines: int) -> bool:
    """Whether the open tab shows the whole target function (nothing left to find or read)."""
    tab = _tab(task, max_lines)
    return tab is not None and tab[2] == tab[3]


def open_tab(task: Task, max_lines: int, files: dict[str, str] | None = None) -> str:
    """The tab's text ("" when there is none): in the first observation the task's files, later
    `files`, the workspace as the episode's edits left it (what an editor shows)."""
    files = task.files if files is None else files
    tab = _tab(task, max_lines, files)
    if tab is None:
        return ""
    path, first, last, _ = tab
    lines = files[path].splitlines(keepends=True)[first - 1 : last]
    return f"Open in the editor: {path}, lines {first}-{last}:\n{''.join(lines)}"
