"""Agent tools: specs with strict argument checking, implementations over a sandbox, call logs.

File tools act on the host copy of the workspace (fast, no process) but only inside it; `grep`,
`run_shell` and `run_tests` execute in the sandbox. A bad call returns an error text to the agent
and never raises into the environment.
"""

import dataclasses
import logging
import os
import shlex
import time
from pathlib import Path

from composer_jax.envs.sandbox import WORKSPACE_MOUNT, Sandbox, WorkspaceLimitError

log = logging.getLogger(__name__)

# Longest path and deepest nesting a tool accepts (Linux's PATH_MAX; far deeper than any repo).
_MAX_PATH_BYTES = 4096
_MAX_PATH_PARTS = 64


@dataclasses.dataclass(frozen=True)
class Param:
    type: str  # "string" | "integer"
    description: str
    required: bool = True


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    params: dict[str, Param]

    def schema(self) -> dict:
        """JSON-schema-like description (for prompts and documentation)."""
        return {
            "name": self.name,
            "description": self.description,
            "parameters": {
                "type": "object",
                "properties": {
                    name: {"type": p.type, "description": p.description}
                    for name, p in self.params.items()
                },
                "required": [name for name, p in self.params.items() if p.required],
                "additionalProperties": False,
            },
        }

    def signature(self) -> str:
        names = [name if p.required else f"{name}?" for name, p in self.params.items()]
        return f"{self.name}({', '.join(names)})"


TOOL_SPECS = {
    spec.name: spec
    for spec in (
        ToolSpec(
            "read_file",
            "Read a workspace file, optionally lines start..end (1-based, inclusive).",
            {
                "path": Param("string", "file path"),
                "start": Param("integer", "first line", required=False),
                "end": Param("integer", "last line", required=False),
            },
        ),
        ToolSpec(
            "write_file",
            "Create or overwrite a workspace file.",
            {"path": Param("string", "file path"), "content": Param("string", "new content")},
        ),
        ToolSpec(
            "edit_file",
            "Replace the one exact occurrence of `old` with `new` in a file.",
            {
                "path": Param("string", "file path"),
                "old": Param("string", "exact text to replace (must occur once)"),
                "new": Param("string", "replacement"),
            },
        ),
        ToolSpec(
            "list_dir",
            "List a workspace directory.",
            {"path": Param("string", "directory", required=False)},
        ),
        ToolSpec(
            "grep",
            "Search workspace files for an extended regular expression.",
            {
                "pattern": Param("string", "regular expression"),
                "path": Param("string", "file or directory", required=False),
            },
        ),
        ToolSpec(
            "run_shell",
            "Run a shell command in the workspace.",
            {"command": Param("string", "command")},
        ),
        ToolSpec("run_tests", "Run the task's visible tests.", {}),
    )
}


def describe_tools(tool_names: tuple[str, ...]) -> str:
    """The tools line of an episode's first observation."""
    return "Tools: " + " ".join(TOOL_SPECS[name].signature() for name in tool_names)


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


class ToolError(Exception):
    """A bad call: its message goes back to the agent."""


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
        typed[name] = value
    return typed


class ToolBox:
    """The tools of one episode, bound to its sandbox."""

    def __init__(
        self,
        sandbox: Sandbox,
        tool_names: tuple[str, ...],
        *,
        strict: bool = True,
        test_command: str | None = None,
        max_output_bytes: int = 4096,
    ):
        unknown = sorted(set(tool_names) - set(TOOL_SPECS))
        if unknown:
            raise ValueError(f"unknown tools {unknown}; available {sorted(TOOL_SPECS)}")
        self.sandbox = sandbox
        self.specs = {name: TOOL_SPECS[name] for name in tool_names}
        self.strict = strict
        self.test_command = test_command
        self.max_output_bytes = max_output_bytes
        self.log: list[ToolCallRecord] = []

    def describe(self) -> str:
        return describe_tools(tuple(self.specs))

    def call(self, tool: str, args: dict[str, str]) -> tuple[str, ToolCallRecord]:
        """Runs one call; returns the text for the agent and the log record."""
        start = time.monotonic()
        error = None
        try:
            if tool not in self.specs:
                raise ToolError(f"unknown tool {tool!r}; available: {', '.join(self.specs)}")
            typed = check_args(self.specs[tool], args, self.strict)
            output = getattr(self, f"_{tool}")(**typed)
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
        )
        self.log.append(record)
        log.debug(
            "tool %s ok=%s %.3fs in=%dB out=%dB",
            tool,
            record.ok,
            record.seconds,
            record.input_bytes,
            record.output_bytes,
        )
        return output, record

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

    def _read_file(self, path: str, start: int | None = None, end: int | None = None) -> str:
        target = self.resolve(path)
        if not target.is_file():
            raise ToolError(f"no such file: {path}")
        lines = target.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        first = max(1, start or 1)
        last = len(lines) if end is None else min(len(lines), end)
        return "".join(lines[first - 1 : last])

    def _write_file(self, path: str, content: str) -> str:
        target = self.resolve(path)
        if target.is_dir():
            raise ToolError(f"{path} is a directory")
        data = content.encode("utf-8", errors="surrogateescape")
        self.sandbox.check_room(target, len(data))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        return f"wrote {len(data)} bytes to {path}"

    def _edit_file(self, path: str, old: str, new: str) -> str:
        target = self.resolve(path)
        if not target.is_file():
            raise ToolError(f"no such file: {path}")
        text = target.read_text(encoding="utf-8", errors="replace")
        occurrences = text.count(old) if old else 0
        if occurrences != 1:
            raise ToolError(f"`old` must occur exactly once in {path}, found {occurrences}")
        data = text.replace(old, new, 1).encode("utf-8", errors="surrogateescape")
        self.sandbox.check_room(target, len(data))
        target.write_bytes(data)
        return f"edited {path}"

    def _list_dir(self, path: str = ".") -> str:
        target = self.resolve(path)
        if not target.is_dir():
            raise ToolError(f"no such directory: {path}")
        entries = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir())
        return "\n".join(entries) if entries else "(empty)"

    def _grep(self, pattern: str, path: str = ".") -> str:
        target = self.resolve(path)
        relative = os.path.relpath(target, self.sandbox.workspace.resolve())
        result = self.sandbox.run(f"grep -rnE -e {shlex.quote(pattern)} -- {shlex.quote(relative)}")
        return result.output or "(no matches)"

    def _run_shell(self, command: str) -> str:
        return _format_result(self.sandbox.run(command))

    def _run_tests(self) -> str:
        if self.test_command is None:
            raise ToolError("this task has no visible tests")
        return _format_result(self.sandbox.run(self.test_command))


def _format_result(result) -> str:
    status = f"exit code {result.returncode}"
    if result.killed_reason:
        status += f" (killed: {result.killed_reason} limit)"
    return f"{result.output}[{status}]"


def _truncate(text: str, max_bytes: int) -> str:
    data = text.encode("utf-8", errors="replace")
    if len(data) <= max_bytes:
        return text
    kept = data[:max_bytes].decode("utf-8", errors="ignore")
    return f"{kept}\n[output truncated: {len(data)} bytes, showing {max_bytes}]"
