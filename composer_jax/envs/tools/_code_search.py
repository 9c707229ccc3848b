"""The `search_code` tool: where a name is defined and used in the workspace, best match first.

Python files are parsed (`ast`) for their definitions (functions, methods, classes, module-level
names) with qualified names and docstrings; every text file is also searched line by line. A
definition whose name is the query outranks one that only contains it, which outranks a
docstring mention; lines follow, the query's exact text first. grep finds text;
this answers "where is `parse` defined" in a repository with a hundred calls to it. A line
matches when it holds every word of the query; a definition may match a part of it.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from pathlib import Path

MAX_FILES = 2000
MAX_FILE_BYTES = 256 * 1024
MAX_HITS = 8
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+")


@dataclasses.dataclass(frozen=True)
class Hit:
    path: str  # relative to the workspace
    line: int
    text: str  # the line, stripped
    score: float
    symbol: str = ""  # "function a.b", "class C", ... for definitions


def words(text: str) -> list[str]:
    """Lower-case words of a name or phrase, snake_case and CamelCase split."""
    out = []
    for token in _WORD.findall(text):
        for part in re.split(r"_+|(?<=[a-z0-9])(?=[A-Z])", token):
            if part:
                out.append(part.lower())
    return out


def _files(root: Path, target: Path) -> list[Path]:
    if target.is_file():
        return [target]
    found = []
    for directory, subdirs, names in os.walk(target):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(names):
            path = Path(directory) / name
            if path.is_file() and not path.is_symlink() and path.stat().st_size <= MAX_FILE_BYTES:
                found.append(path)
            if len(found) >= MAX_FILES:
                return found
    return found


def _definitions(tree: ast.Module):
    """(qualified name, kind, line, docstring) of every definition, outermost first."""
    stack = [(node, "") for node in tree.body]
    while stack:
        node, owner = stack.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            if kind == "function" and owner:
                kind = "method"
            qualname = f"{owner}{node.name}"
            yield qualname, kind, node.lineno, ast.get_docstring(node) or ""
            stack += [(child, f"{qualname}.") for child in node.body]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and not owner:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    yield target.id, "name", node.lineno, ""


def _definition_score(qualname: str, docstring: str, query: str, query_words: set[str]) -> float:
    name = qualname.rsplit(".", 1)[-1]
    if query in (name, qualname):
        return 100.0
    if query.lower() in (name.lower(), qualname.lower()):
        return 90.0
    name_words = set(words(qualname))
    shared = len(query_words & name_words) / len(query_words)
    score = 60.0 * shared if shared == 1 else 30.0 * shared
    if query.lower() in qualname.lower():
        score = max(score, 40.0)
    documented = len(query_words & set(words(docstring))) / len(query_words)
    return score + 10.0 * documented


def search(root: Path, target: Path, query: str, limit: int = MAX_HITS) -> list[Hit]:
    """The best `limit` hits for `query` under `target` (a file or folder inside `root`)."""
    query = query.strip()
    query_words = set(words(query))
    if not query_words:
        raise ValueError("the query holds no name or word")
    hits: list[Hit] = []
    for path in _files(root, target):
        relative = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable: nothing to search
        lines = text.splitlines()
        defined_lines = set()
        if relative.endswith(".py"):
            try:
                tree = ast.parse(text)
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                tree = None
            for qualname, kind, line, doc in _definitions(tree) if tree is not None else ():
                score = _definition_score(qualname, doc, query, query_words)
                if score > 0 and line <= len(lines):
                    hits.append(
                        Hit(relative, line, lines[line - 1].strip(), score, f"{kind} {qualname}")
                    )
                    defined_lines.add(line)
        for number, line in enumerate(lines, 1):
            if number in defined_lines:
                continue
            lowered = line.lower()
            if all(word in lowered for word in query_words):
                exact = query.lower() in lowered
                hits.append(Hit(relative, number, line.strip()[:200], 10.0 + 5.0 * exact))
    hits.sort(key=lambda h: (-h.score, h.path, h.line))
    return hits[:limit]


def format_hits(hits: list[Hit]) -> str:
    return "\n".join(
        f"{h.path}:{h.line}: {h.text}" + (f"  [{h.symbol}]" if h.symbol else "") for h in hits
    )
