"""A scripted agent that solves a task the way the report's agent works, for SFT and tests.

Given a task with an oracle solution, `OracleScript` plans the episode with the tools the profile
offers: find the function (search_code), read it (read_file, the lines around it; both left out
when the first observation's open tab shows the whole function), plan (todo),
edit the removed body back (edit_file with the smallest unique hunk; write_file when the change
is not one hunk), run the visible tests, complete the plan, and say what changed and how it was
tested. When the workflow asks for a summary it writes one that carries what the next generation
needs (the function, its docstring, what is done, what is next, the code it will write). `OracleEngine` puts the scripts
behind the engine interface `agent.play` drives, so a warm start learns from episodes played
through the very workflow and environments RL uses.

A script may also make one mistake (`mistake_rng`): a wrong version of one of its calls, of a
kind a feedback detector flags (`MISTAKES`), right before the call it meant. The environment
rejects it and the next turn is the right call, so the episode shows the detector's hint (in the
teacher context) next to the turn that answers it (`agent.sft`). And it may first edit a wrong
body in (`repair_rng`: one line of the solution changed, `wrong_body`), so the visible tests fail,
and then fix that line alone and run them again: an episode that acts on a failing test, which
RL can then reinforce.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import io
import re
import tokenize

import numpy as np

from composer_jax.agent.workflow import SUMMARY_OPEN
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.envs import Task
from composer_jax.envs.grading import protocol
from composer_jax.envs.tasks import focus
from composer_jax.envs.tools import TOOLS, resolve_tool, run_tests_outputs
from composer_jax.infer import Completion, SamplingParams


@dataclasses.dataclass(frozen=True)
class Change:
    """The oracle's change to one file: a unique hunk (`old` -> `new`) or the whole file."""

    path: str
    old: str | None  # None: write the whole file
    new: str
    name: str  # the function (qualified name) the change is in, else the path
    line: int  # its first line in the task's file (1 without a function)
    end: int  # its last line there
    doc: str  # its docstring's first paragraph ("" without)
    start: int  # `new`'s first line in the solution's file (0-based)


def _hunk(before: list[str], after: list[str]) -> tuple[int, int, int, int]:
    """The region holding every change: before[i1:i2] becomes after[j1:j2]."""
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    changed = [op for op in matcher.get_opcodes() if op[0] != "equal"]
    return changed[0][1], changed[-1][2], changed[0][3], changed[-1][4]


def _enclosing(source: str, line: int) -> tuple[str, int, int, str] | None:
    """(qualified name, first line, last line, docstring) of the innermost function holding
    `line` (1-based)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    found = None
    for name, node in focus.definitions(tree):  # a container before what it holds
        end = node.end_lineno or node.lineno
        if not isinstance(node, ast.ClassDef) and node.lineno <= line <= end:
            doc = (ast.get_docstring(node) or "").split("\n\n")[0].strip()
            found = (name, node.lineno, end, doc)
    return found


def _lines(text: str) -> list[str]:
    """The lines of `text` with their ends, split at "\n" only (as `ast` and `tokenize` count
    lines; `str.splitlines` also splits at form feeds and other separators)."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


def unique_hunk(before_text: str, after_text: str) -> tuple[str, str, int, int] | None:
    """(old, new, old's first line, new's first line; 0-based) of the region of `before_text`
    that `after_text` changes, widened by the unchanged lines around it until `old` occurs in
    `before_text` once, there (a line above, else one below, else both, each step); None when
    `before_text` is empty."""
    before, after = _lines(before_text), _lines(after_text)
    i1, i2, j1, j2 = _hunk(before, after)

    def unique(start: int, end: int) -> bool:
        """`old` occurs only at its own place (overlapping occurrences counted: an edit
        replaces the first)."""
        old, offset = "".join(before[start:end]), len("".join(before[:start]))
        found = before_text.find(old)
        return bool(old) and found == offset and before_text.find(old, found + 1) == -1

    while not unique(i1, i2):
        if i1 == 0 and i2 == len(before):
            return None
        above, below = min(i1, 1), int(i2 < len(before))
        if above and unique(i1 - 1, i2):
            below = 0
        elif below and unique(i1, i2 + 1):
            above = 0
        i1, j1, i2, j2 = i1 - above, j1 - above, i2 + below, j2 + below
    return "".join(before[i1:i2]), "".join(after[j1:j2]), i1, j1


def plan_change(task: Task) -> Change:
    """How the oracle solution differs from the task's files (the first changed file)."""
    path = next(p for p, text in sorted(task.oracle_files.items()) if task.files.get(p) != text)
    after_text = task.oracle_files[path]
    before_text = task.files.get(path)
    hunk = None if before_text is None else unique_hunk(before_text, after_text)
    if hunk is None:
        return Change(path, None, after_text, path, 1, 1, "", 0)
    old, new, first, start = hunk
    enclosing = _enclosing(before_text, first + 1)
    if enclosing is None:
        return Change(path, old, new, path, 1, 1, "", start)
    name, line, last, doc = enclosing
    return Change(path, old, new, name, line, last, doc, start)


# Each kind of scripted mistake, and the feedback detector that flags it.
MISTAKES = {
    "unknown_argument": "invalid_arguments",
    "missing_argument": "invalid_arguments",
    "unknown_tool": "unknown_tool",
    "tool_unavailable": "tool_unavailable",
}
# Names a confused model reaches for (the tiny policy's own mistakes include `todo` with a `path`
# and a tool called "path").
_WRONG_ARGUMENTS = ("path", "file", "line", "new", "name", "content", "query")
_WRONG_TOOLS = ("open_file", "view", "find", "edit", "test", "path")


def mistaken_call(
    tool: str, args: dict[str, str], tools: tuple[str, ...], kinds: tuple[str, ...], rng
) -> tuple[str, dict[str, str]] | None:
    """A wrong version of the call `tool(args)` that a strict environment rejects, of one of
    `kinds` (keys of MISTAKES) drawn with `rng`, or None when none applies. An unavailable tool
    is only used for a call that names a path, so that the right call (on the same path) answers
    the error (`feedback.IgnoredToolError`)."""
    params = resolve_tool(tool).spec.params
    options = {
        "unknown_argument": [n for n in _WRONG_ARGUMENTS if n not in params],
        "missing_argument": [n for n, p in params.items() if p.required],
        "unknown_tool": [n for n in _WRONG_TOOLS if n not in TOOLS],
        "tool_unavailable": [n for n in TOOLS if n not in tools] if "path" in args else [],
    }
    usable = [kind for kind in kinds if options.get(kind)]
    if not usable:
        return None
    kind = usable[rng.integers(len(usable))]
    choice = options[kind][rng.integers(len(options[kind]))]
    if kind == "unknown_argument":
        return tool, {**args, choice: args.get("path") or next(iter(args.values()), "1")}
    if kind == "missing_argument":
        return tool, {name: value for name, value in args.items() if name != choice}
    return choice, dict(args)


# A repair's first, wrong body (`wrong_bodies`) changes one line of the solution in one of these
# ways, so that what the failing test points at differs from episode to episode: the last
# `return`'s value one more (a number off by one; a TypeError for a list or a string), an
# operator or a boolean swapped, a whole-number constant one more, a simple statement left out.
WRONG_BODIES = ("off_by_one", "operator", "constant", "dropped_line")
_SWAPS = {
    "+": "-", "-": "+", "+=": "-=", "-=": "+=", "<": "<=", "<=": "<", ">": ">=", ">=": ">",
    "==": "!=", "!=": "==", "and": "or", "or": "and", "True": "False", "False": "True",
    "//": "/", "%": "//",
}  # fmt: skip


def wrong_bodies(change: Change, stub: str, solution: str) -> dict[str, list[str]]:
    """The one-line wrong versions of `change.new` (`solution` is its file), by kind of
    `WRONG_BODIES`: each parses once edited into `stub` in place of `change.old`. Only code the
    change adds is changed (never its context lines, a docstring or a comment): a `return`,
    operators and constants from the solution's tokens and syntax tree, and a left-out statement
    that is not a `return`/`raise`, a docstring or a block's only statement."""
    if change.old is None or not change.new:
        return {}
    lines = _lines(change.new)
    _, _, k1, k2 = _hunk(_lines(change.old), lines)  # the lines the change adds, in `new`
    first = change.start + 1  # `new`'s first row in `solution` (1-based, as ast counts)
    rows = range(first + k1, first + k2)
    found: dict[str, list[str]] = {kind: [] for kind in WRONG_BODIES}

    def replaced(row: int, col: int, end: int, text: str | None) -> str:
        """The body with `row`'s columns col:end replaced by `text` (None: the line left out)."""
        i = row - first
        line = [] if text is None else [lines[i][:col] + text + lines[i][end:]]
        return "".join(lines[:i] + line + lines[i + 1 :])

    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(solution).readline))
        tree = ast.parse(solution)
    except (SyntaxError, tokenize.TokenError, ValueError, RecursionError):
        return {}
    returns = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Return)
        and node.value is not None
        and node.lineno in rows
        and node.value.lineno == node.value.end_lineno
    ]
    if returns:
        value = max(returns, key=lambda node: node.lineno).value
        line = lines[value.lineno - first]
        col, end = _char_col(line, value.col_offset), _char_col(line, value.end_col_offset)
        wrong = f"({line[col:end]}) + 1"
        found["off_by_one"].append(replaced(value.lineno, col, end, wrong))
    for tok in tokens:
        (row, col), (end_row, end) = tok.start, tok.end
        if row not in rows or end_row != row:
            continue
        if tok.type in (tokenize.OP, tokenize.NAME) and tok.string in _SWAPS:
            found["operator"].append(replaced(row, col, end, _SWAPS[tok.string]))
        elif tok.type == tokenize.NUMBER and tok.string.isdigit():
            found["constant"].append(replaced(row, col, end, str(int(tok.string) + 1)))
    for statement in _droppable(tree):
        if statement.lineno in rows:
            found["dropped_line"].append(replaced(statement.lineno, 0, 0, None))
    return {
        kind: [w for w in wrong if _parses(stub.replace(change.old, w, 1)) and w != change.new]
        for kind, wrong in found.items()
    }


def _char_col(line: str, byte_col: int) -> int:
    """`ast`'s column (UTF-8 bytes) as a character index into `line`."""
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


def _droppable(tree: ast.AST):
    """The one-line statements that can be left out: not a block's only statement, a
    `return`/`raise`, or a docstring."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list) or len(block) < 2:
                continue
            for i, statement in enumerate(block):
                docstring = (
                    i == 0
                    and isinstance(statement, ast.Expr)
                    and isinstance(getattr(statement, "value", None), ast.Constant)
                )
                one_line = statement.lineno == statement.end_lineno
                if (
                    one_line
                    and not docstring
                    and not isinstance(statement, (ast.Return, ast.Raise))
                ):
                    yield statement


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return False
    return True


def wrong_body(change: Change, stub: str, solution: str, rng: np.random.Generator) -> str | None:
    """One wrong body (`wrong_bodies`): a kind drawn with `rng` among those the change allows,
    then one of its versions; None when there is none."""
    found = {kind: wrong for kind, wrong in wrong_bodies(change, stub, solution).items() if wrong}
    if not found:
        return None
    kinds = sorted(found)
    wrong = found[kinds[rng.integers(len(kinds))]]
    return wrong[rng.integers(len(wrong))]


class OracleScript:
    """The turns of one solved episode, in order, with the tools of the profile; with
    `mistake_rng`, one of its calls is first made wrong, with a mistake of one of
    `mistake_kinds`; with `repair_rng`, its edit is first a wrong body (`wrong_body`, drawn with
    it) that the visible tests run on, then fixed by the smallest edit (where the tools and the
    change allow one; `self.repaired` says whether it is)."""

    def __init__(
        self,
        task: Task,
        tools: tuple[str, ...],
        open_tab_lines: int = 0,
        mistake_rng: np.random.Generator | None = None,
        mistake_kinds: tuple[str, ...] = tuple(MISTAKES),
        repair_rng: np.random.Generator | None = None,
    ):
        self.task, self.change = task, plan_change(task)
        self.steps: list[tuple[str, str, str]] = []  # (what it did, what it will do, the turn)
        self._calls: dict[int, tuple[str, dict[str, str]]] = {}  # step -> its call
        c = self.change
        short = c.name.rsplit(".", 1)[-1]
        shown = self._tab_shows_target = focus.tab_shows_target(task, open_tab_lines)
        if "search_code" in tools and c.old is not None and not shown:
            self._add(("found it", "find it"), "search_code", query=short)
        if "read_file" in tools and not shown:
            span = {"start": str(c.line), "end": str(c.end)} if c.old is not None else {}
            self._add(("read it", "read it"), "read_file", path=c.path, **span)
        planned = "todo" in tools
        if planned:
            self._add(("planned", "plan"), "todo", action="create", text=f"implement {c.name}")
        tested = "run_tests" in tools and task.visible_test_command is not None
        stub, solution = task.files.get(c.path, ""), task.oracle_files[c.path]
        wrong = None
        if repair_rng is not None and tested and "edit_file" in tools:
            wrong = wrong_body(c, stub, solution, repair_rng)
        # (the mistaken turn, the right one: "" for a wrong edit, which a failing test answers)
        self.mistakes: list[tuple[str, str]] = []
        self.fix: tuple[str, str] | None = None  # the repair's edit: the smallest unique hunk
        if wrong is not None:
            self._add(
                (f"edited {c.path}", f"edit {c.path}"),
                "edit_file",
                path=c.path,
                old=c.old,
                new=wrong,
            )
            self._add(("ran the tests: they fail", "run the tests"), "run_tests")
            self.mistakes.append((self.steps[-2][2], ""))
            self.fix = unique_hunk(stub.replace(c.old, wrong, 1), solution)[:2]
        self._edit_step = len(self.steps)
        if self.fix is not None:
            old_lines, new_lines = self.fix
            self._add(
                (f"fixed {c.name}", f"fix {c.name}"),
                "edit_file",
                path=c.path,
                old=old_lines,
                new=new_lines,
            )
        elif c.old is not None and "edit_file" in tools:
            self._add(
                (f"edited {c.path}", f"edit {c.path}"),
                "edit_file",
                path=c.path,
                old=c.old,
                new=c.new,
            )
        else:
            self._add(
                (f"wrote {c.path}", f"write {c.path}"), "write_file", path=c.path, content=c.new
            )
        if tested:
            self._add(("ran the tests", "run the tests"), "run_tests")
        if planned:
            self._add(
                ("completed the plan", "complete the plan"), "todo", action="complete", id="1"
            )
        how = "ran the tests: they pass." if tested else "not tested: there are no visible tests."
        final = f"Implemented {c.name} in {c.path}; {how}"
        self.steps.append(("reported", "report", protocol.render_turn(final=final)))
        self.done = 0
        self._mistake_before: dict[int, str] = {}  # a mistake's turn, by the step it precedes
        if mistake_rng is not None:
            self._plan_mistake(tools, mistake_kinds, mistake_rng)

    @property
    def repaired(self) -> bool:
        return self.fix is not None

    def _add(self, what: tuple[str, str], tool: str, **args: str) -> None:
        self._calls[len(self.steps)] = (tool, args)
        self.steps.append((*what, protocol.render_call(tool, args)))

    def _plan_mistake(self, tools: tuple[str, ...], kinds: tuple[str, ...], rng) -> None:
        steps = list(self._calls)
        for step in rng.permutation(steps):
            wrong = mistaken_call(*self._calls[int(step)], tools, kinds, rng)
            if wrong is not None:
                turn = protocol.render_call(*wrong)
                self._mistake_before[int(step)] = turn
                self.mistakes.append((turn, self.steps[int(step)][2]))
                return

    def next_turn(self) -> str:
        step = min(self.done, len(self.steps) - 1)
        mistake = self._mistake_before.pop(step, None)
        if mistake is not None:
            return mistake
        self.done += 1
        return self.steps[step][2]

    def summary(self, context: str = "") -> str:
        """What a fresh start from the task needs: where the function is, what its docstring
        says, what is done and what comes next, and before the edit the code to write. Before a
        repair's fix, what the failing test said (read from `context`, the generation so far)
        and the lines the fix writes: the lines it replaces are left to the open tab, so the fix
        is learned as copying them from the file, not from the summary."""
        c = self.change
        done = ", ".join(did for did, _, _ in self.steps[: self.done]) or "nothing yet"
        following = self.steps[self.done][1] if self.done < len(self.steps) else "nothing"
        doc = f": {c.doc}" if c.doc else ""
        where = f"{c.name} ({c.path}, lines {c.line}-{c.end})"
        if self.fix is not None and self.done == self._edit_step:
            return f"{where}\nDone: {done}. Next: {following}.{self._fix_plan(context)}</summary>"
        # Before the edit, the code it will write: worked out here, with the file in view, so the
        # next generation copies it instead of re-deriving it from a restated docstring.
        plan = ""
        if c.old is not None and self.done <= self._edit_step:
            plan = f"\nThe new body:\n{c.new}"
        return f"{where}{doc}\nDone: {done}. Next: {following}.{plan}</summary>"

    def _fix_plan(self, context: str) -> str:
        """A repair's plan at the failing test, inside the summary's token budget (the docstring
        is in the restarted tab): the lines the fix writes, then what the test raised (cut
        short, and where the budget cuts the summary). The lines it replaces are left to
        the open tab where it shows the function, so the fix learns to copy them from the file."""
        old, new = (text.rstrip("\n") for text in self.fix)
        plan = "" if self._tab_shows_target else f"\nThe lines:\n{old}"
        plan += f"\nThe fix writes:\n{new}"
        failure = failing_test_line(context)
        return plan + (f"\nThe tests failed: {failure[:100]}" if failure else "")


def failing_test_line(transcript: str) -> str:
    """What the last `run_tests` output says failed ("" when it passed or shows no status): its
    last line naming an exception (the assertion's message for a failed assert; pytest's `E`
    line), else its last line."""
    outputs = run_tests_outputs(transcript)
    if not outputs or outputs[-1][1] in (0, None):
        return ""
    lines = [line.strip() for line in outputs[-1][0].splitlines() if line.strip()]
    raised = [line for line in lines if protocol.RAISED_LINE.match(line)]
    return (raised or lines or [""])[-1]


@dataclasses.dataclass
class _Request:
    script: OracleScript
    context: list[int]
    fed: list[int]  # the tokens prefilled for this turn
    start: int
    params: SamplingParams


class OracleEngine:
    """Scripts behind the InferenceEngine interface: each request's next turn is its script's,
    its summary when the context asks for one. Routes are zeros (SFT does not read them)."""

    def __init__(
        self,
        scripts: list[OracleScript],
        tokenizer: Tokenizer,
        num_slots: int,
        max_len: int,
        moe_layers: int = 1,
        k: int = 1,
    ):
        self._unused = list(scripts)
        self.tokenizer, self.num_slots, self.max_len = tokenizer, num_slots, max_len
        self._route = np.zeros((moe_layers, k), np.int32)
        self._requests: dict[int, _Request] = {}
        self._running: list[int] = []
        self._next = 0
        self.completions: dict[int, Completion] = {}

    def _new(self, request: _Request) -> int:
        rid, self._next = self._next, self._next + 1
        self._requests[rid] = request
        self._running.append(rid)
        return rid

    def submit(self, prompt, params) -> int:
        text = self.tokenizer.decode(prompt)
        script = next((s for s in self._unused if s.task.prompt in text), None)
        if script is None:
            raise ValueError("no oracle script for this prompt")
        self._unused.remove(script)
        return self._new(_Request(script, list(prompt), list(prompt), 0, params))

    def continue_request(self, request_id, appended, params) -> int:
        old = self._requests.pop(request_id)
        fed = [old.context[-1], *appended]  # the engine prefills the last turn's last token
        context = old.context + list(appended)
        return self._new(_Request(old.script, context, fed, len(old.context) - 1, params))

    def restart_request(self, request_id, keep, appended, params) -> int:
        old = self._requests.pop(request_id)
        context = old.context[:keep] + list(appended)
        return self._new(_Request(old.script, context, list(appended), keep, params))

    def release(self, request_id) -> None:
        self._requests.pop(request_id, None)

    def step(self) -> list[int]:
        done, self._running = self._running, []
        for rid in done:
            request = self._requests[rid]
            decoded = self.tokenizer.decode(request.context)
            asks_summary = decoded.endswith(SUMMARY_OPEN)
            text = request.script.summary(decoded) if asks_summary else request.script.next_turn()
            # As the engine: at most max_new_tokens (a cut turn fails, and its episode is left
            # out of SFT).
            tokens = list(self.tokenizer.encode(text))[: request.params.max_new_tokens]
            completion = Completion(rid, request.fed, request.start)
            completion.prompt_experts = [self._route] * len(request.fed)
            for token in tokens:
                completion.record(token, 0.0, 0.0, 0, self._route)
            completion.finish_reason = "stop"
            request.context += tokens
            self.completions[rid] = completion
        return done
