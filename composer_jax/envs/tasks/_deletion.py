"""Deleting a function's body (signature and docstring kept): the edit `repo_factory` makes to
a package's function to turn it into a task."""

import ast


def deletable_functions(
    source: str, *, min_body_lines: int = 1, dunders: tuple[str, ...] = ("__init__",)
) -> list[tuple[str, int, int, int]]:
    """(qualified name, first body line, last line, indent) of the top-level functions and
    methods whose body (after the docstring) starts on a line of its own and spans at least
    `min_body_lines` lines; dunders only when named in `dunders`."""
    found = []
    for node in ast.parse(source).body:
        members = [(node, "")]
        if isinstance(node, ast.ClassDef):
            members = [(item, f"{node.name}.") for item in node.body]
        for item, owner in members:
            if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if item.name.startswith("__") and item.name not in dunders:
                continue
            body = item.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            if not body or item.end_lineno - body[0].lineno + 1 < min_body_lines:
                continue
            if body[0].col_offset <= item.col_offset:
                continue  # a one-line def: the body shares the signature's line
            if any(n.lineno == body[0].lineno for n in body[1:]):
                continue  # statements joined by `;`
            found.append((owner + item.name, body[0].lineno, item.end_lineno, body[0].col_offset))
    return found


def delete_body(source: str, first: int, last: int, indent: int) -> str:
    """`source` with lines first..last replaced by `raise NotImplementedError`."""
    lines = source.splitlines(keepends=True)
    stub = " " * indent + "raise NotImplementedError\n"
    return "".join(lines[: first - 1]) + stub + "".join(lines[last:])
