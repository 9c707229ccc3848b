"""Agent tools: one registry of specs and implementations, strict argument checking, profiles.

Every tool is a `Tool` (its `ToolSpec` and a function `(box, **typed_args) -> text`) in `TOOLS`,
added with `@register_tool(spec)`; a researcher's own tool is named by import path in a profile
(`my_pkg.tools:lint`, a `Tool` object) and imported where the episode runs, so nothing in the
package changes. A profile is the tool set one episode offers (`TOOL_PROFILES`, or a comma list
of names): a registered tool left out of it answers "tool not available", which feedback can
target. File tools act on the host copy of the workspace (fast, no process) but only inside it;
`grep`, `run_shell` and `run_tests` execute in the sandbox. A bad call returns an error text to
the agent and never raises into the environment.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import logging
import os
import re
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from composer_jax import plugins
from composer_jax.envs.sandbox.box import WORKSPACE_MOUNT, Sandbox, WorkspaceLimitError
from composer_jax.envs.tools import _code_search
from composer_jax.envs.tools.todo import TodoList

log = logging.getLogger(__name__)

# Longest path and deepest nesting a tool accepts (Linux's PATH_MAX; far deeper than any repo).
_MAX_PATH_BYTES = 4096
_MAX_PATH_PARTS = 64


@dataclasses.dataclass(frozen=True)
class Param:
    type: str  # "string" | "integer"
    description: str
    required: bool = True
    choices: tuple[str, ...] = ()  # a string argument's allowed values (empty: any)


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    params: dict[str, Param]

    def schema(self) -> dict:
        """JSON-schema-like description (for prompts and documentation)."""
        properties = {}
        for name, p in self.params.items():
            properties[name] = {"type": p.type, "description": p.description}
            if p.choices:
                properties[name]["enum"] = list(p.choices)
        return {
            "name": self.name,
            "description": self.description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": [name for name, p in self.params.items() if p.required],
                "additionalProperties": False,
            },
        }

    def signature(self) -> str:
        names = [name if p.required else f"{name}?" for name, p in self.params.items()]
        return f"{self.name}({', '.join(names)})"


@dataclasses.dataclass(frozen=True)
class Tool:
    spec: ToolSpec
    run: Callable[..., str]  # (box: ToolBox, **typed arguments) -> the text for the agent


TOOLS: dict[str, Tool] = {}


def register_tool(spec: ToolSpec) -> Callable:
    """Decorator: registers `fn(box, **args) -> str` as the tool `spec` describes."""

    def register(fn: Callable[..., str]) -> Callable[..., str]:
        TOOLS[spec.name] = Tool(spec, fn)
        return fn

    return register


class _Specs(collections.abc.Mapping):
    """The registered tools' specs by name (a live view of TOOLS)."""

    def __getitem__(self, name: str) -> ToolSpec:
        return TOOLS[name].spec

    def __iter__(self):
        return iter(TOOLS)

    def __len__(self) -> int:
        return len(TOOLS)


TOOL_SPECS = _Specs()


def resolve_tool(name: str) -> Tool:
    """A registered tool, or a `Tool` named by import path (`module:attribute`)."""
    tool = plugins.resolve(TOOLS, name, "tool")
    if not isinstance(tool, Tool):
        raise ValueError(f"tool {name!r} is a {type(tool).__name__}, not a composer_jax Tool")
    return tool


def describe_tools(tool_names: tuple[str, ...]) -> str:
    """The tools line of an episode's first observation."""
    return "Tools: " + " ".join(resolve_tool(name).spec.signature() for name in tool_names)


@dataclasses.dataclass(frozen=True)
class ToolCallRecord:
    """Log entry of one call: what, whether it worked, how long, how big."""

    tool: str
    args: dict[str, str]
    ok: bool
    error: str | None
    seconds: float
    input_bytes: int
    output_bytes: int
    exit_code: int | None = None  # a command's (run_shell, run_tests); None for other tools


class ToolError(Exception):
    """A bad call: its message goes back to the agent."""


def unavailable_message(tool: str, offered: tuple[str, ...]) -> str:
    """The error of a call to a registered tool the episode's profile leaves out."""
    return (
        f"tool not available: {tool} is not offered in this episode (tools: {', '.join(offered)})"
    )


def check_args(spec: ToolSpec, args: dict[str, str], strict: bool) -> dict:
    """Validates and converts protocol strings to typed arguments.

    Strict (training): unknown arguments and non-canonical integers are errors. Lenient (eval):
    unknown arguments are ignored and integers may carry surrounding whitespace.
    """
    unknown = sorted(set(args) - set(spec.params))
    if unknown and strict:
        raise ToolError(f"{spec.name}: unknown argument(s) {unknown}; expected {spec.signature()}")
    typed = {}
    for name, param in spec.params.items():
        if name not in args:
            if param.required:
                raise ToolError(
                    f"{spec.name}: missing argument {name!r}; expected {spec.signature()}"
                )
            continue
        value = args[name]
        if param.type == "integer":
            text = value if strict else value.strip()
            digits = text[1:] if text.startswith("-") else text
            if not digits.isascii() or not digits.isdigit() or len(digits) > 9:
                raise ToolError(f"{spec.name}: argument {name!r} must be an integer, got {value!r}")
            value = int(text)
        elif param.choices:
            value = value if strict else value.strip()
            if value not in param.choices:
                raise ToolError(
                    f"{spec.name}: argument {name!r} must be one of {', '.join(param.choices)}, "
                    f"got {value[:40]!r}"
                )
        typed[name] = value
    return typed


class ToolBox:
    """The tools of one episode (its profile), bound to its sandbox; holds the episode's todo list."""

    def __init__(
        self,
        sandbox: Sandbox,
        tool_names: tuple[str, ...],
        *,
        strict: bool = True,
        test_command: str | None = None,
        test_binds: dict[str, str] | None = None,
        max_output_bytes: int = 4096,
    ):
        self.sandbox = sandbox
        self.test_binds = test_binds  # read-only host paths the test command needs (pytest)
        self.tools = {name: resolve_tool(name) for name in tool_names}
        self.specs = {name: tool.spec for name, tool in self.tools.items()}
        self.strict = strict
        self.test_command = test_command
        self.max_output_bytes = max_output_bytes
        self.log: list[ToolCallRecord] = []
        self.todo = TodoList()
        self._exit_code: int | None = None  # the running call's command's, for its record

    def describe(self) -> str:
        return describe_tools(tuple(self.tools))

    def call(self, tool: str, args: dict[str, str]) -> tuple[str, ToolCallRecord]:
        """Runs one call; returns the text for the agent and the log record."""
        start = time.monotonic()
        error, self._exit_code = None, None
        try:
            output = self._run(tool, args)
        except (ToolError, WorkspaceLimitError) as failure:
            error = str(failure)
            output = f"error: {error}"
        except (OSError, UnicodeError, ValueError, RecursionError, MemoryError) as failure:
            # A safety net: what the model wrote must never crash the environment.
            error = f"{type(failure).__name__}: {str(failure)[:200]}"
            output = f"error: {error}"
        output = _truncate(output, self.max_output_bytes)
        record = ToolCallRecord(
            tool=tool,
            args=dict(args),
            ok=error is None,
            error=error,
            seconds=time.monotonic() - start,
            input_bytes=sum(len(v.encode("utf-8", "replace")) for v in args.values()),
            output_bytes=len(output.encode("utf-8", "replace")),
            exit_code=self._exit_code,
        )
        self.log.append(record)
        log.debug("tool %s ok=%s %.3fs", tool, record.ok, record.seconds)
        return output, record

    def command_output(self, result) -> str:
        """A sandboxed command's output for the agent, its exit code kept for the call's record.
        Output past `max_output_bytes` keeps its end (where a traceback says what failed) and
        the status line."""
        self._exit_code = result.returncode
        status = f"exit code {result.returncode}"
        if result.killed_reason:
            status += f" (killed: {result.killed_reason} limit)"
        status = f"[{status}]"
        return _truncate_head(result.output, self.max_output_bytes - len(status)) + status

    def _run(self, tool: str, args: dict[str, str]) -> str:
        if tool not in self.tools:
            if tool in TOOLS:
                raise ToolError(unavailable_message(tool, tuple(self.tools)))
            raise ToolError(f"unknown tool {tool!r}; available: {', '.join(self.tools)}")
        implementation = self.tools[tool]
        return implementation.run(self, **check_args(implementation.spec, args, self.strict))

    def resolve(self, path: str) -> Path:
        """A workspace path from what the agent wrote; refuses anything that leaves it."""
        if "\x00" in path:
            raise ToolError("path contains a NUL byte")
        if len(path.encode("utf-8", "replace")) > _MAX_PATH_BYTES:
            raise ToolError(f"path is longer than {_MAX_PATH_BYTES} bytes")
        if path.count("/") >= _MAX_PATH_PARTS:
            raise ToolError(f"path is nested deeper than {_MAX_PATH_PARTS} levels")
        if path == WORKSPACE_MOUNT or path.startswith(WORKSPACE_MOUNT + "/"):
            path = path[len(WORKSPACE_MOUNT) :].lstrip("/")
        if os.path.isabs(path):
            raise ToolError(f"path {path!r} is outside the workspace")
        root = self.sandbox.workspace.resolve()
        target = (root / path).resolve()
        if target != root and root not in target.parents:
            raise ToolError(f"path {path!r} is outside the workspace")
        return target


_PATH = Param("string", "file path")


@register_tool(
    ToolSpec(
        "read_file",
        "Read a workspace file, optionally lines start..end (1-based, inclusive).",
        {
            "path": _PATH,
            "start": Param("integer", "first line", required=False),
            "end": Param("integer", "last line", required=False),
        },
    )
)
def _read_file(box: ToolBox, path: str, start: int | None = None, end: int | None = None) -> str:
    target = box.resolve(path)
    if not target.is_file():
        raise ToolError(f"no such file: {path}")
    lines = target.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    first = max(1, start or 1)
    last = len(lines) if end is None else min(len(lines), end)
    return "".join(lines[first - 1 : last])


@register_tool(
    ToolSpec(
        "write_file",
        "Create or overwrite a workspace file.",
        {"path": _PATH, "content": Param("string", "new content")},
    )
)
def _write_file(box: ToolBox, path: str, content: str) -> str:
    target = box.resolve(path)
    if target.is_dir():
        raise ToolError(f"{path} is a directory")
    data = content.encode("utf-8", errors="surrogateescape")
    box.sandbox.check_room(target, len(data))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return f"wrote {len(data)} bytes to {path}"


@register_tool(
    ToolSpec(
        "edit_file",
        "Replace the one exact occurrence of `old` with `new` in a file.",
        {
            "path": _PATH,
            "old": Param("string", "exact text to replace (must occur once)"),
            "new": Param("string", "replacement"),
        },
    )
)
def _edit_file(box: ToolBox, path: str, old: str, new: str) -> str:
    target = box.resolve(path)
    if not target.is_file():
        raise ToolError(f"no such file: {path}")
    text = target.read_text(encoding="utf-8", errors="replace")
    occurrences = text.count(old) if old else 0
    if occurrences != 1:
        raise ToolError(f"`old` must occur exactly once in {path}, found {occurrences}")
    data = text.replace(old, new, 1).encode("utf-8", errors="surrogateescape")
    box.sandbox.check_room(target, len(data))
    target.write_bytes(data)
    return f"edited {path}"


@register_tool(
    ToolSpec(
        "list_dir",
        "List a workspace directory.",
        {"path": Param("string", "directory", required=False)},
    )
)
def _list_dir(box: ToolBox, path: str = ".") -> str:
    target = box.resolve(path)
    if not target.is_dir():
        raise ToolError(f"no such directory: {path}")
    entries = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir())
    return "\n".join(entries) if entries else "(empty)"


@register_tool(
    ToolSpec(
        "grep",
        "Search workspace files for an extended regular expression.",
        {
            "pattern": Param("string", "regular expression"),
            "path": Param("string", "file or directory", required=False),
        },
    )
)
def _grep(box: ToolBox, pattern: str, path: str = ".") -> str:
    target = box.resolve(path)
    relative = os.path.relpath(target, box.sandbox.workspace.resolve())
    result = box.sandbox.run(f"grep -rnE -e {shlex.quote(pattern)} -- {shlex.quote(relative)}")
    return result.output or "(no matches)"


@register_tool(
    ToolSpec(
        "run_shell",
        "Run a shell command in the workspace.",
        {"command": Param("string", "command")},
    )
)
def _run_shell(box: ToolBox, command: str) -> str:
    return box.command_output(box.sandbox.run(command))


@register_tool(ToolSpec("run_tests", "Run the task's visible tests.", {}))
def _run_tests(box: ToolBox) -> str:
    if box.test_command is None:
        raise ToolError("this task has no visible tests")
    return box.command_output(box.sandbox.run(box.test_command, extra_ro_binds=box.test_binds))


@register_tool(
    ToolSpec(
        "todo",
        "Keep a plan: create an item, update its text, complete it, or list the items.",
        {
            "action": Param("string", "what to do", choices=TodoList.ACTIONS),
            "text": Param("string", "the item's text (create, update)", required=False),
            "id": Param("integer", "the item's number (update, complete)", required=False),
        },
    )
)
def _todo(box: ToolBox, action: str, text: str | None = None, id: int | None = None) -> str:
    try:
        return box.todo.apply(action, text, id)
    except ValueError as error:
        raise ToolError(f"todo: {error}") from None


@register_tool(
    ToolSpec(
        "search_code",
        "Find where a name is defined or used: Python definitions first, then matching lines, "
        "best matches first.",
        {
            "query": Param("string", "a name or words to look for"),
            "path": Param("string", "file or directory", required=False),
        },
    )
)
def _search_code(box: ToolBox, query: str, path: str = ".") -> str:
    target = box.resolve(path)
    if not target.exists():
        raise ToolError(f"no such file or directory: {path}")
    try:
        hits = _code_search.search(box.sandbox.workspace.resolve(), target, query)
    except ValueError as error:
        raise ToolError(f"search_code: {error}") from None
    return _code_search.format_hits(hits) if hits else "(no matches)"


# The original seven tools, in the order every earlier prompt listed them.
DEFAULT_TOOLS = (
    "read_file",
    "write_file",
    "edit_file",
    "list_dir",
    "grep",
    "run_shell",
    "run_tests",
)
TOOL_PROFILES: dict[str, tuple[str, ...]] = {
    "default": DEFAULT_TOOLS,
    # The report's agent: files, search, shell, tests and a plan.
    "agent": (*DEFAULT_TOOLS, "search_code", "todo"),
    # The agent without a shell: commands only through the task's tests.
    "agent_no_shell": (*(t for t in DEFAULT_TOOLS if t != "run_shell"), "search_code", "todo"),
}


def tool_profile(spec: str) -> tuple[str, ...]:
    """The tools a profile spec offers: a name in TOOL_PROFILES, or a comma list of tool names
    and import paths. Raises ValueError naming every tool that does not exist."""
    if spec in TOOL_PROFILES:
        return TOOL_PROFILES[spec]
    names = tuple(part.strip() for part in spec.split(",") if part.strip())
    if not names:
        raise ValueError(f"empty tool profile {spec!r}; profiles: {', '.join(TOOL_PROFILES)}")
    problems = []
    for name in names:
        try:
            resolve_tool(name)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ValueError(
            f"{'; '.join(problems)} (a profile is one of {', '.join(TOOL_PROFILES)} or a comma "
            "list of tools)"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"tool profile {spec!r} names a tool twice")
    return names


# `run_tests` outputs in a transcript (the turn protocol wraps each: `<output tool="run_tests">
# ...[exit code N]\n</output>`); the status is the last line, after whatever the tests print.
_TEST_OUTPUT = re.compile(r'<output tool="run_tests">(.*?)</output>', re.S)
_EXIT = re.compile(r"\[exit code (-?\d+)[^\]\n]*\]\s*$")


def run_tests_outputs(transcript: str) -> list[tuple[str, int | None]]:
    """(what the tests printed, the exit code: None when the output was cut off before its
    status) of each `run_tests` output in a decoded transcript, in order."""
    found = []
    for output in _TEST_OUTPUT.finditer(transcript):
        text = output.group(1)
        status = _EXIT.search(text)
        found.append((text[: status.start()], int(status.group(1))) if status else (text, None))
    return found


def run_tests_exit_codes(transcript: str) -> list[int]:
    """The exit code of each `run_tests` output in a decoded transcript that shows one."""
    return [code for _, code in run_tests_outputs(transcript) if code is not None]


def _truncate_head(text: str, max_bytes: int) -> str:
    """`text` within `max_bytes`, its end kept (the marker line takes at most 64 of them)."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= max_bytes:
        return text
    kept = data[len(data) - max(max_bytes - 64, 0) :].decode("utf-8", errors="ignore")
    return f"[output truncated: {len(data)} bytes, showing the last {len(kept)}]\n{kept}"


def _truncate(text: str, max_bytes: int) -> str:
    data = text.encode("utf-8", errors="replace")
    if len(data) <= max_bytes:
        return text
    kept = data[:max_bytes].decode("utf-8", errors="ignore")
    return f"{kept}\n[output truncated: {len(data)} bytes, showing {max_bytes}]"
