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
body in (`repair`: its result off by one, `wrong_body`), so the visible tests fail, and then fix
it and run them again: an episode that acts on a failing test, which RL can then reinforce.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import re

import numpy as np

from composer_jax.agent.workflow import SUMMARY_OPEN
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.envs import Task
from composer_jax.envs.grading import protocol
from composer_jax.envs.tasks import focus
from composer_jax.envs.tools import TOOLS, resolve_tool
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


def plan_change(task: Task) -> Change:
    """How the oracle solution differs from the task's files (the first changed file)."""
    path = next(p for p, text in sorted(task.oracle_files.items()) if task.files.get(p) != text)
    after_text = task.oracle_files[path]
    before_text = task.files.get(path)
    if before_text is None:
        return Change(path, None, after_text, path, 1, 1, "")
    before, after = before_text.splitlines(keepends=True), after_text.splitlines(keepends=True)
    i1, i2, j1, j2 = _hunk(before, after)
    # Widen by the unchanged lines around it until the old text occurs exactly once.
    while not ("".join(before[i1:i2]) and before_text.count("".join(before[i1:i2])) == 1):
        if i1 == 0 and i2 == len(before):
            return Change(path, None, after_text, path, 1, 1, "")
        if i1 > 0:
            i1, j1 = i1 - 1, j1 - 1
        if i2 < len(before):
            i2, j2 = i2 + 1, j2 + 1
    old, new = "".join(before[i1:i2]), "".join(after[j1:j2])
    enclosing = _enclosing(before_text, i1 + 1)
    if enclosing is None:
        return Change(path, old, new, path, 1, 1, "")
    name, first, last, doc = enclosing
    return Change(path, old, new, name, first, last, doc)


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


def wrong_body(change: Change, stub: str) -> str | None:
    """`change.new` with its last `return` one more (a number off by one; a TypeError for a
    list or a string), which the visible tests fail, when it stays unique in the file once
    edited in (so a repair can name it); else None."""
    returns = list(re.finditer(r"^( *)return (.+)$", change.new, re.M))
    if change.old is None or not returns:
        return None
    last = returns[-1]
    line = f"{last.group(1)}return ({last.group(2)}) + 1"
    wrong = change.new[: last.start()] + line + change.new[last.end() :]
    edited = stub.replace(change.old, wrong, 1)
    return wrong if edited.count(wrong) == 1 else None


class OracleScript:
    """The turns of one solved episode, in order, with the tools of the profile; with
    `mistake_rng`, one of its calls is first made wrong, with a mistake of one of
    `mistake_kinds`; with `repair`, its edit is first a wrong body that the visible tests fail
    (where the tools and the change allow one; `self.repaired` says whether it is)."""

    def __init__(
        self,
        task: Task,
        tools: tuple[str, ...],
        open_tab_lines: int = 0,
        mistake_rng: np.random.Generator | None = None,
        mistake_kinds: tuple[str, ...] = tuple(MISTAKES),
        repair: bool = False,
    ):
        self.task, self.change = task, plan_change(task)
        self.steps: list[tuple[str, str, str]] = []  # (what it did, what it will do, the turn)
        self._calls: dict[int, tuple[str, dict[str, str]]] = {}  # step -> its call
        c = self.change
        short = c.name.rsplit(".", 1)[-1]
        shown = focus.tab_shows_target(task, open_tab_lines)
        if "search_code" in tools and c.old is not None and not shown:
            self._add(("found it", "find it"), "search_code", query=short)
        if "read_file" in tools and not shown:
            span = {"start": str(c.line), "end": str(c.end)} if c.old is not None else {}
            self._add(("read it", "read it"), "read_file", path=c.path, **span)
        planned = "todo" in tools
        if planned:
            self._add(("planned", "plan"), "todo", action="create", text=f"implement {c.name}")
        tested = "run_tests" in tools and task.visible_test_command is not None
        wrong = wrong_body(c, task.files[c.path]) if repair and tested else None
        self.repaired = wrong is not None and "edit_file" in tools
        # (the mistaken turn, the right one: "" for a wrong edit, which a failing test answers)
        self.mistakes: list[tuple[str, str]] = []
        if self.repaired:
            self._add(
                (f"edited {c.path}", f"edit {c.path}"),
                "edit_file",
                path=c.path,
                old=c.old,
                new=wrong,
            )
            self._add(("ran the tests: they fail", "run the tests"), "run_tests")
            self.mistakes.append((self.steps[-2][2], ""))
        self._edit_step = len(self.steps)
        if self.repaired:
            self._add(
                (f"fixed {c.name}", f"fix {c.name}"), "edit_file", path=c.path, old=wrong, new=c.new
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

    def summary(self) -> str:
        """What a fresh start from the task needs: where the function is, what its docstring
        says, what is done and what comes next, and before the edit the code to write."""
        c = self.change
        done = ", ".join(did for did, _, _ in self.steps[: self.done]) or "nothing yet"
        following = self.steps[self.done][1] if self.done < len(self.steps) else "nothing"
        doc = f": {c.doc}" if c.doc else ""
        # Before the edit, the code it will write: worked out here, with the file in view, so the
        # next generation copies it instead of re-deriving it from a restated docstring.
        before_edit = c.old is not None and self.done <= self._edit_step
        plan = f"\nThe new body:\n{c.new}" if before_edit else ""
        return (
            f"{c.name} ({c.path}, lines {c.line}-{c.end}){doc}\nDone: {done}. Next: "
            f"{following}.{plan}</summary>"
        )


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
            asks_summary = self.tokenizer.decode(request.context).endswith(SUMMARY_OPEN)
            text = request.script.summary() if asks_summary else request.script.next_turn()
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
