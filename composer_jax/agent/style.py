"""The style monitor on an episode's diff: what the agent's written Python looks like, read as code.

Only lines the episode added count (a task's own old comments are not the agent's). Comments
come from `tokenize` (the AST drops them), code structure from `ast`, so a `#` inside a string is
never a comment and a comment is judged by what it holds:
  - commented_out_code: a comment whose text parses as a Python statement that does something
    (a call, an assignment, a return, an import), i.e. dead code left behind;
  - long_comment: a block of more than MAX_COMMENT_LINES consecutive added comment lines;
  - long_line (over MAX_LINE characters) and tab_indent;
  - syntax_error: the file does not parse (its added lines all count).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import io
import tokenize

MAX_LINE = 100
MAX_COMMENT_LINES = 3
_ACTIONS = (
    ast.Call,
    ast.Assign,
    ast.AugAssign,
    ast.AnnAssign,
    ast.Return,
    ast.Import,
    ast.ImportFrom,
    ast.If,
    ast.For,
    ast.While,
    ast.Raise,
    ast.Delete,
)


@dataclasses.dataclass(frozen=True)
class StyleIssue:
    path: str
    line: int  # 1-based, in the file after the episode
    kind: str
    detail: str = ""


def added_lines(before: str | None, after: str) -> set[int]:
    """1-based numbers of the lines of `after` that `before` does not have in place."""
    old, new = (before or "").splitlines(), after.splitlines()
    added = set()
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for tag, _, _, start, end in matcher.get_opcodes():
        if tag in ("replace", "insert"):
            added.update(range(start + 1, end + 1))
    return added


def _is_code(comment: str) -> bool:
    text = comment.lstrip("#").strip()
    if not text:
        return False
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return any(isinstance(node, _ACTIONS) for node in ast.walk(tree))


def _comments(source: str) -> list[tuple[int, str, bool]]:
    """(line, text, alone on its line) of every comment token."""
    found = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                alone = not token.line[: token.start[1]].strip()
                found.append((token.start[0], token.string, alone))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # the parse check reports the file
    return found


def file_issues(path: str, before: str | None, after: str) -> list[StyleIssue]:
    """Issues on the lines of `after` that the episode added."""
    added = added_lines(before, after)
    if not added:
        return []
    try:
        ast.parse(after)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        return [StyleIssue(path, n, "syntax_error", str(error)[:80]) for n in sorted(added)]
    issues = []
    lines = after.splitlines()
    for number in sorted(added):
        line = lines[number - 1]
        indent = line[: len(line) - len(line.lstrip())]
        if "\t" in indent:
            issues.append(StyleIssue(path, number, "tab_indent"))
        if len(line) > MAX_LINE:
            issues.append(StyleIssue(path, number, "long_line", f"{len(line)} characters"))
    block: list[int] = []
    for number, text, alone in _comments(after):
        if number not in added:
            continue
        if alone and (not block or number == block[-1] + 1):
            block.append(number)
        else:
            if len(block) > MAX_COMMENT_LINES:
                issues += [
                    StyleIssue(path, n, "long_comment", f"{len(block)} lines") for n in block
                ]
            block = [number] if alone else []
        if _is_code(text):
            issues.append(StyleIssue(path, number, "commented_out_code", text[:60]))
    if len(block) > MAX_COMMENT_LINES:
        issues += [StyleIssue(path, n, "long_comment", f"{len(block)} lines") for n in block]
    return issues


def diff_issues(changes: dict[str, dict]) -> tuple[list[StyleIssue], int]:
    """Issues of every changed Python file (`envs.environment.changed_files`) and how many lines
    the episode added to those files."""
    issues, total = [], 0
    for path, change in sorted(changes.items()):
        after = change.get("after")
        if not path.endswith(".py") or after is None:
            continue
        total += len(added_lines(change.get("before"), after))
        issues += file_issues(path, change.get("before"), after)
    return issues, total
