"""The episode text protocol: how an agent's turn and the environment's replies look as text.

Plain tags a small byte-level model can learn:

    <think>reasoning</think>
    <call tool="write_file"><arg name="path">a.py</arg><arg name="content">
    def f(x):
        return x
    </arg></call>
    <final>message to the user</final>

The environment answers each call with `<output tool="NAME">text</output>` (a closing tag inside
the text escaped as `<\\/output>`, so an output ends only where the environment ends it). A
multi-line value is written between newlines that the parser strips, so `render` and
`parse_turn` are inverses. The parser scans forward with `str.find` only (linear time, no regex
backtracking) and never raises: whatever does not parse is reported in `Turn.errors` and counted
as untagged text.
"""

import dataclasses
import re

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
FINAL_OPEN, FINAL_CLOSE = "<final>", "</final>"
CALL_OPEN, CALL_CLOSE = "<call", "</call>"
ARG_OPEN, ARG_CLOSE = "<arg", "</arg>"
OUTPUT_OPEN, OUTPUT_CLOSE = "<output", "</output>"
ESCAPED_OUTPUT_CLOSE = "<\\/output>"
_MAX_HEADER = 200


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call; `text` is its exact span in the model output (for token counting).
    `complete`: it and each of its arguments were closed (a turn cut off mid-call is not)."""

    tool: str
    args: dict[str, str]
    text: str = ""
    complete: bool = True


@dataclasses.dataclass(frozen=True)
class Turn:
    """A parsed agent turn. `final` is None when the turn has no final message."""

    thinking: str = ""
    calls: tuple[ToolCall, ...] = ()
    final: str | None = None
    untagged: str = ""
    errors: tuple[str, ...] = ()
    # Exact text spans per kind, so token counts add up to the whole output.
    think_text: str = ""
    final_text: str = ""


def _wrap(value: str) -> str:
    return f"\n{value}\n" if "\n" in value else value


def _unwrap(value: str) -> str:
    if len(value) >= 2 and value.startswith("\n") and value.endswith("\n"):
        return value[1:-1]
    return value


class UnrenderableError(ValueError):
    """A name or value the turn protocol cannot carry (it holds a marker)."""


def _check_free_of(value: str, marker: str, what: str) -> None:
    if marker in value:
        raise UnrenderableError(f"{what} must not contain {marker!r}")


def render_call(tool: str, args: dict[str, str]) -> str:
    """Renders a call; raises UnrenderableError for names or values the protocol cannot
    carry."""
    _check_free_of(tool, '"', "tool name")
    _check_free_of(tool, "\n", "tool name")
    parts = [f'<call tool="{tool}">']
    for name, value in args.items():
        _check_free_of(name, '"', "argument name")
        _check_free_of(name, "\n", "argument name")
        # Generation stops at a turn's closing markers, so no model could write them here.
        for marker in (ARG_CLOSE, CALL_CLOSE, FINAL_CLOSE):
            _check_free_of(value, marker, "argument value")
        parts.append(f'<arg name="{name}">{_wrap(value)}{ARG_CLOSE}')
    parts.append(CALL_CLOSE)
    return "".join(parts)


def render_turn(
    thinking: str = "", calls: tuple[tuple[str, dict[str, str]], ...] = (), final: str | None = None
) -> str:
    """Renders a turn as the model should write it."""
    pieces = []
    if thinking:
        _check_free_of(thinking, THINK_CLOSE, "thinking")
        pieces.append(f"{THINK_OPEN}{_wrap(thinking)}{THINK_CLOSE}")
    pieces += [render_call(tool, args) for tool, args in calls]
    if final is not None:
        _check_free_of(final, FINAL_CLOSE, "final message")
        pieces.append(f"{FINAL_OPEN}{_wrap(final)}{FINAL_CLOSE}")
    return "\n".join(pieces)


def render_output(tool: str, text: str) -> str:
    """The environment's reply to one call. A closing tag in the text (a program may print one)
    is written `<\\/output>`: an output ends only where the environment ends it, so nothing the
    tests print can pass for another output and its status."""
    text = text.replace(OUTPUT_CLOSE, ESCAPED_OUTPUT_CLOSE)
    return f'{OUTPUT_OPEN} tool="{tool}">{_wrap(text)}{OUTPUT_CLOSE}'


# A line of a test run's output naming what was raised: `TypeError: ...`, pytest's `E   ...`.
RAISED_LINE = re.compile(r"^\s*(?:E\s+)?[\w.]*(?:Error|Exception|Exit|Interrupt)\b")


def _last_output_body(observation: str) -> tuple[list[str], int, int]:
    """(the observation's lines, the index of the first body line of its last output, the body's
    length): (lines, 0, 0) unless the observation ends with a multi-line output."""
    lines = observation.split("\n")
    if lines[-1] != OUTPUT_CLOSE:
        return lines, 0, 0
    # Closing tags inside outputs are escaped: the last output opens after the one before it.
    previous = observation.rfind(OUTPUT_CLOSE, 0, len(observation) - len(OUTPUT_CLOSE))
    first = observation.count("\n", 0, previous) + 1 if previous >= 0 else 0
    openers = (i for i in range(first, len(lines) - 1) if lines[i].startswith(OUTPUT_OPEN))
    opener = next(openers, None)
    if opener is None:
        return lines, 0, 0
    return lines, opener + 1, len(lines) - 2 - opener


def cuttable_output_lines(observation: str) -> int:
    """How many first lines of the observation's last output a cut may take: those before what
    was raised (the last run of lines naming it, `RAISED_LINE`, or of pytest's `E` lines) and
    before its last two lines (how it ended: the exit code, pytest's count)."""
    lines, start, length = _last_output_body(observation)
    body = lines[start : start + length]
    failure = [i for i, line in enumerate(body) if RAISED_LINE.match(line) or line.startswith("E ")]
    while len(failure) > 1 and failure[-2] == failure[-1] - 1:
        failure.pop()
    return max(min([length - 2, *failure[-1:]]), 0)


def cut_output_head(observation: str, cut: int, note: str) -> str:
    """The observation with the first `cut` lines of its last output replaced by `note`
    (formatted with `cut`); `cut` at most `cuttable_output_lines(observation)`."""
    if not cut:
        return observation
    lines, start, _ = _last_output_body(observation)
    return "\n".join([*lines[:start], note.format(cut), *lines[start + cut :]])


def _attribute(header: str, name: str) -> str | None:
    key = f'{name}="'
    start = header.find(key)
    if start < 0:
        return None
    start += len(key)
    end = header.find('"', start)
    return header[start:end] if end >= 0 else None


def _parse_args(body: str, errors: list[str]) -> tuple[dict[str, str], bool]:
    """(the arguments, whether each one was closed)."""
    args: dict[str, str] = {}
    closed = True
    pos = 0
    while True:
        start = body.find(ARG_OPEN, pos)
        if start < 0:
            break
        header_end = body.find(">", start, start + _MAX_HEADER)
        if header_end < 0:
            errors.append("malformed <arg> header")
            break
        name = _attribute(body[start:header_end], "name")
        close = body.find(ARG_CLOSE, header_end + 1)
        if close < 0:
            errors.append(f"unterminated <arg> {name!r}")
            closed, close = False, len(body)
        if name is None:
            errors.append("<arg> without name")
        elif name in args:
            errors.append(f"duplicate argument {name!r}")
        else:
            args[name] = _unwrap(body[header_end + 1 : close])
        pos = close + len(ARG_CLOSE)
    return args, closed


def parse_turn(text: str) -> Turn:
    """Parses a model turn. Total: any string gives a Turn, problems go to `errors`."""
    thinking, think_text, untagged, final, final_text = [], [], [], None, []
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    # Next occurrence of each opening tag, refreshed only once passed: keeps the scan linear.
    next_at = {tag: -1 for tag in (THINK_OPEN, CALL_OPEN, FINAL_OPEN)}
    while pos < len(text):
        for tag, at in next_at.items():
            if at < pos:
                found = text.find(tag, pos)
                next_at[tag] = found if found >= 0 else len(text)
        start, tag = min((at, tag) for tag, at in next_at.items())
        if start >= len(text):
            untagged.append(text[pos:])
            break
        untagged.append(text[pos:start])
        if tag == CALL_OPEN:
            header_end = text.find(">", start, start + _MAX_HEADER)
            tool = _attribute(text[start:header_end], "tool") if header_end >= 0 else None
            if tool is None:
                errors.append("malformed <call> header")
                untagged.append(tag)
                pos = start + len(tag)
                continue
            close = text.find(CALL_CLOSE, header_end + 1)
            if close < 0:
                errors.append(f"unterminated <call> to {tool!r}")
                end = len(text)
            else:
                end = close + len(CALL_CLOSE)
            body = text[header_end + 1 : close if close >= 0 else len(text)]
            args, closed = _parse_args(body, errors)
            calls.append(ToolCall(tool, args, text[start:end], complete=closed and close >= 0))
            pos = end
            continue
        closing = THINK_CLOSE if tag == THINK_OPEN else FINAL_CLOSE
        close = text.find(closing, start + len(tag))
        if close < 0:
            errors.append(f"unterminated {tag}")
            end = content_end = len(text)
        else:
            content_end, end = close, close + len(closing)
        content = _unwrap(text[start + len(tag) : content_end])
        if tag == THINK_OPEN:
            thinking.append(content)
            think_text.append(text[start:end])
        else:
            if final is not None:
                errors.append("more than one <final>")
            final = content if final is None else final + "\n" + content
            final_text.append(text[start:end])
        pos = end
    return Turn(
        thinking="\n".join(thinking),
        calls=tuple(calls),
        final=final,
        untagged="".join(untagged),
        errors=tuple(errors),
        think_text="".join(think_text),
        final_text="".join(final_text),
    )


@dataclasses.dataclass
class EpisodeCounts:
    """The episode's token counts by kind, in the unit of `count_tokens` (any `text -> int`, e.g.
    a tokenizer's `count_tokens`; an `Episode` counts UTF-8 bytes unless given one). Untagged text
    counts as thinking (free-form reasoning). The trainer's length penalty does not read these:
    it counts the policy's own tokens by kind in the rollout's token buffers, whatever the
    tokenizer (`composer_jax.agent.kinds.token_kinds`)."""

    thinking_tokens: int = 0
    tool_call_tokens: int = 0
    tool_output_tokens: int = 0
    final_tokens: int = 0
    tool_calls: int = 0
    turns: int = 0

    def add_turn(self, turn: Turn, count_tokens) -> None:
        self.turns += 1
        self.thinking_tokens += count_tokens(turn.think_text) + count_tokens(turn.untagged)
        self.tool_call_tokens += sum(count_tokens(call.text) for call in turn.calls)
        self.final_tokens += count_tokens(turn.final_text)
        self.tool_calls += len(turn.calls)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def count_bytes(text: str) -> int:
    """Token count under the byte tokenizer: one token per UTF-8 byte."""
    return len(text.encode("utf-8", errors="surrogatepass"))
