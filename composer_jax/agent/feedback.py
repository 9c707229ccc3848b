"""Text feedback: detectors flag an agent turn with a hint, and the hinted context teaches.

After each environment step the workflow turns the agent's turn into a `TurnRecord` (its text,
the tool-call log entries it produced, the environment's reply) and every configured detector
may flag it with a short hint. The *teacher* context is the generation's token sequence with the
rendered hints inserted right before the flagged turn (`generation.teacher_sequence`); the policy
is distilled toward the teacher's predictions on that turn's tokens only, so it learns to act as
if it had been told. Detectors work from what the environment actually recorded
(`ToolCallRecord.ok` / `error`), re-checking arguments with `check_args` to tell an argument error
from a failure of the tool itself. `DETECTORS` is the registry; `rl.agent.feedback_detectors` names
them, or a researcher's own class by import path (`my_pkg.feedback:Slow`).
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Protocol

from composer_jax import plugins
from composer_jax.envs import Episode, StepResult
from composer_jax.envs.sandbox import WORKSPACE_MOUNT
from composer_jax.envs.tools import TOOLS, ToolCallRecord, ToolError, check_args, resolve_tool

MAX_LINE = 100
_WRITTEN_TEXT = {"write_file": "content", "edit_file": "new"}  # the code a call writes


@dataclasses.dataclass(frozen=True)
class TurnRecord:
    """One agent turn as the coordinator saw it."""

    index: int  # turn number in the episode (0-based)
    text: str  # the model's output for the turn
    calls: tuple[ToolCallRecord, ...]  # the call-log entries this turn produced
    observation: str  # the environment's reply text
    available_tools: tuple[str, ...]


class Detector(Protocol):
    name: str

    def check(self, turn: TurnRecord, previous: TurnRecord | None) -> str | None:
        """A hint when the turn is flagged, else None."""


def record_step(episode: Episode, index: int, text: str) -> tuple[StepResult, TurnRecord]:
    """Steps the episode with one turn and records it: the calls are the log entries it added."""
    first = len(episode.call_log)
    result = episode.step(text)
    record = TurnRecord(
        index=index,
        text=text,
        calls=tuple(episode.call_log[first:]),
        observation=result.observation,
        available_tools=tuple(episode.tools.specs),
    )
    return result, record


def _spec(name: str):
    return resolve_tool(name).spec


def _argument_error(call: ToolCallRecord) -> str | None:
    """The strict argument check's message for a known tool's call, None when the args pass."""
    try:
        check_args(_spec(call.tool), call.args, strict=True)
    except ToolError as error:
        return str(error)
    return None


def _offered(turn: TurnRecord) -> str:
    return ", ".join(_spec(name).signature() for name in turn.available_tools)


class UnknownTool:
    """A call to a tool that does not exist."""

    name = "unknown_tool"

    def check(self, turn: TurnRecord, previous: TurnRecord | None) -> str | None:
        unknown = [
            c.tool for c in turn.calls if c.tool not in turn.available_tools and c.tool not in TOOLS
        ]
        if not unknown:
            return None
        return f"There is no tool {unknown[0]!r}. The available tools are: {_offered(turn)}."


class ToolUnavailable:
    """A call to a tool that exists but that this episode's tool profile does not offer (it
    answered "tool not available")."""

    name = "tool_unavailable"

    def check(self, turn: TurnRecord, previous: TurnRecord | None) -> str | None:
        missing = [
            c.tool for c in turn.calls if c.tool not in turn.available_tools and c.tool in TOOLS
        ]
        if not missing:
            return None
        return (
            f"The tool {missing[0]} is not available here; use only these tools: {_offered(turn)}."
        )


class InvalidArguments:
    """A known tool rejected its arguments (missing, unknown or malformed parameter).

    Only failed calls are checked, so a lenient environment that ignored an extra argument is
    not second-guessed; the strict check separates argument errors from tool failures such as a
    missing file.
    """

    name = "invalid_arguments"

    def check(self, turn: TurnRecord, previous: TurnRecord | None) -> str | None:
        for call in turn.calls:
            if call.ok or call.tool not in turn.available_tools:
                continue
            error = _argument_error(call)
            if error is not None:
                params = "; ".join(
                    f"{name}: {p.description}" + ("" if p.required else " (optional)")
                    for name, p in _spec(call.tool).params.items()
                )
                return f"Invalid arguments: {error}. Parameters of {call.tool}: {params or 'none'}."
        return None


def call_path(call: ToolCallRecord) -> str | None:
    """The workspace path a call names, normalised (optional paths default to the root)."""
    spec = TOOLS[call.tool].spec if call.tool in TOOLS else None
    if spec is None or "path" not in spec.params:
        return None
    path = call.args.get("path", ".").strip()
    if path == WORKSPACE_MOUNT or path.startswith(WORKSPACE_MOUNT + "/"):
        path = path[len(WORKSPACE_MOUNT) :].lstrip("/") or "."
    return posixpath.normpath(path)


def _addresses(call: ToolCallRecord, failed: ToolCallRecord, available: tuple[str, ...]) -> bool:
    """Whether `call` responds to the failed call: see `IgnoredToolError`."""
    if call.tool not in available or (call.tool, call.args) == (failed.tool, failed.args):
        return False
    involved = call_path(failed)
    if involved is None or call.tool == failed.tool:
        return True
    return call_path(call) in (involved, posixpath.dirname(involved) or ".")


class IgnoredToolError:
    """The previous turn's tool call failed and this turn carries on as if it had not.

    A failed call F (`ok` is False) is addressed by a call C of this turn when C is to an
    available tool, is not an identical repeat of F (same tool and arguments), and either
    changes F (same tool, other arguments), or F names no file (any other call is a change of
    course), or C reads, lists, edits or rewrites F's file or lists its directory. The turn is
    flagged when some failed call of the previous turn is left unaddressed: e.g. it repeats the
    failing call unchanged, goes straight to a final message, or works on an unrelated file.
    """

    name = "ignored_tool_error"

    def check(self, turn: TurnRecord, previous: TurnRecord | None) -> str | None:
        if previous is None:
            return None
        for failed in previous.calls:
            if failed.ok or any(_addresses(c, failed, turn.available_tools) for c in turn.calls):
                continue
            fix = "look at the file it names or change the call"
            if call_path(failed) is None:
                fix = "change the call"
            return (
                f"Your previous call to {failed.tool} failed with: {failed.error}. "
                f"Do not ignore it or repeat it unchanged: {fix} first."
            )
        return None


class StyleRule:
    """Python code written with write_file/edit_file breaks the style: a tab in a line's
    indentation, or a line over 100 characters. Checked whether or not the call succeeded (the
    style is the model's either way); non-Python files are skipped (a Makefile needs tabs)."""

    name = "style"

    def check(self, turn: TurnRecord, previous: TurnRecord | None) -> str | None:
        for call in turn.calls:
            field = _WRITTEN_TEXT.get(call.tool)
            if field is None or not call.args.get("path", "").endswith(".py"):
                continue
            for number, line in enumerate(call.args.get(field, "").splitlines(), 1):
                indent = line[: len(line) - len(line.lstrip())]
                problem = "is indented with a tab" if "\t" in indent else None
                if len(line) > MAX_LINE:
                    problem = f"has {len(line)} characters"
                if problem is not None:
                    return (
                        f"Style: indent with 4 spaces, never tabs, and keep lines at most "
                        f"{MAX_LINE} characters; line {number} of the {field} written to "
                        f"{call.args['path']} {problem}."
                    )
        return None


DETECTORS: dict[str, type] = {
    cls.name: cls
    for cls in (UnknownTool, ToolUnavailable, InvalidArguments, IgnoredToolError, StyleRule)
}


def make_detectors(names: tuple[str, ...]) -> list[Detector]:
    """One instance of each named detector (registered, or a class by import path); a
    ValueError names every name that is neither."""
    problems, classes = [], []
    for name in names:
        try:
            classes.append(plugins.resolve(DETECTORS, name, "detector"))
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ValueError("; ".join(problems))
    return [cls() for cls in classes]


def check_turn(
    detectors: list[Detector], turn: TurnRecord, previous: TurnRecord | None
) -> list[tuple[str, str]]:
    """(detector name, hint) of every detector that flags the turn."""
    hints = [(d.name, d.check(turn, previous)) for d in detectors]
    return [(name, hint) for name, hint in hints if hint is not None]


def render_hint(hints: list[tuple[str, str]]) -> str:
    """The text inserted before the flagged turn in the teacher context, one line per hint."""
    return "".join(f"[feedback] {hint}\n" for _, hint in hints)
