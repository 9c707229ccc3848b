"""Replay grading: the deleted function called on the inputs the package's own tests gave it,
its outcomes compared with the original's outside the process that ran it.

The factory records, on the original code, the arguments of every call the graded tests make
to the target function (`_repo_runner`'s `record` mode) and the outcome of replaying each call on
the original (twice: a call whose outcomes differ is dropped as nondeterministic). At grading,
`PROGRAM` runs in the sandbox on the grading tree: it imports the candidate's module, calls the
function on each recorded input and prints the outcomes; the host decodes them strictly (JSON
and the harness's tagged plain data, never pickle or eval) and compares them type-strictly with
the expected ones, which never enter the sandbox. Forging an outcome therefore means producing
the original's values, which is solving the task; an object that only claims equality cannot
be encoded at all.

A recorded input is the codec's plain data, where a function or class argument may be a
["ref", [module, qualname, import root]] that only the program in the sandbox resolves (the
host's decoder refuses refs). An outcome is {"result": r, "args_after": a}: r is ["value", v] (a
plain-data return value), ["iter", [v, ...], end] (the first `items` items of an iterator
result; end is "end", "more" or ["raise", name]), ["raise", name] (the exception's qualified
type), ["timeout"], ["opaque", type name] or ["unresolved", error] (an input that did not
resolve); a is the arguments after the call (in-place mutations count), or None.
"""

from __future__ import annotations

import json
import secrets
import shlex
from pathlib import Path

from composer_jax.envs.grading import harness, repo_grading

ITEMS = 64  # items taken from an iterator result (infinite generators included)
CALL_SECONDS = 5.0
MAX_OUTCOME_BYTES = 1 << 16
_TAGS = ("value", "iter", "raise", "timeout", "opaque", "unresolved")

# Runs as `python3 -I -S -B -c PROGRAM` in the grading tree, its input on stdin; everything the
# candidate prints goes to stderr, the outcomes to a private copy of stdout after a marker.
PROGRAM = r"""
import importlib, json, os, signal, sys
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
spec = json.loads(sys.stdin.readline())
CODEC
root = os.path.realpath(spec["root"])
sys.path[:0] = [root]
sys.path.extend(spec["lib"])  # pytest, for a test module that a recorded argument names
os.chdir(root)


class CallTimeout(BaseException):
    pass


def on_alarm(signum, frame):
    raise CallTimeout()


def type_name(kind):
    return f"{kind.__module__}.{kind.__qualname__}"


def encoded(value):
    data = encode(value)
    if len(json.dumps(data)) > spec["max_bytes"]:
        raise TypeError("too large")
    return data


def result_of(value):
    try:
        return ["value", encoded(value)]
    except TypeError:
        pass
    if not hasattr(type(value), "__next__"):
        return ["opaque", type_name(type(value))]
    items = []
    while len(items) < spec["items"]:
        try:
            item = next(value)
        except StopIteration:
            return ["iter", items, "end"]
        except CallTimeout:
            raise
        except BaseException as error:
            return ["iter", items, ["raise", type_name(type(error))]]
        try:
            items.append(encoded(item))
        except TypeError:
            return ["opaque", type_name(type(item))]
    return ["iter", items, "more"]


def resolve(name):  # the function or class a recorded argument names
    module, qualname, entry = name
    if type(module) is not str or type(qualname) is not str or type(entry) not in (str, type(None)):
        raise ValueError("malformed name")
    if entry is not None:
        path = os.path.realpath(os.path.join(root, entry))
        if path != root and not path.startswith(root + "/"):
            raise ValueError("an import root outside the tree")
        if path not in sys.path:
            sys.path.append(path)
    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def outcome(function, call):
    try:
        args, kwargs = decode(call, resolve=resolve)
    except BaseException as error:
        return {"result": ["unresolved", type_name(type(error))], "args_after": None}
    signal.setitimer(signal.ITIMER_REAL, spec["call_seconds"])
    try:
        result = result_of(function(*args, **kwargs))
    except CallTimeout:
        result = ["timeout"]
    except BaseException as error:
        result = ["raise", type_name(type(error))]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        after = encoded([args, kwargs])
    except BaseException:
        after = None
    return {"result": result, "args_after": after}


signal.signal(signal.SIGALRM, on_alarm)
try:
    function = importlib.import_module(spec["module"])
    for part in spec["qualname"].split("."):
        function = getattr(function, part)
    reply = {"outcomes": [outcome(function, call) for call in spec["calls"]]}
except BaseException as error:
    reply = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
out.write(spec["marker"] + " " + json.dumps(reply) + "\n")
out.flush()
os._exit(0)
"""
_PROGRAM = PROGRAM.replace("CODEC", harness.CODEC_SOURCE)


class ReplayError(ValueError):
    """Replay output that is missing or malformed (grades as no call matched)."""


def module_name(path: str) -> str:
    """The import name of a repository module path ("toolz/itertoolz.py" -> toolz.itertoolz)."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def referenced_modules(replay: dict) -> dict[tuple[str, str | None], set[str]]:
    """{(module, import root): the top-level names referred to} of every ["ref", ...] in the
    recorded inputs: what the replay's tree must keep (a test module's helper passed as an
    argument, say)."""
    found: dict[tuple[str, str | None], set[str]] = {}

    def walk(data) -> None:
        if not isinstance(data, list):
            return
        if len(data) == 2 and data[0] == "ref" and isinstance(data[1], list):
            module, qualname, import_root = data[1]
            found.setdefault((module, import_root), set()).add(qualname.split(".")[0])
            return
        for item in data:
            walk(item)

    for call in replay["calls"]:
        walk(call["input"])
    return found


def command(root: str | Path, replay: dict) -> tuple[str, str, str]:
    """(shell command, its stdin, the marker of its reply) replaying `replay`'s calls on the
    tree at `root`; only the inputs go in, never the expected outcomes."""
    marker = secrets.token_hex(16)
    spec = {
        "root": str(root),
        "module": replay["module"],
        "qualname": replay["qualname"],
        "calls": [call["input"] for call in replay["calls"]],
        "lib": repo_grading.library_path(),
        "items": ITEMS,
        "call_seconds": CALL_SECONDS,
        "max_bytes": MAX_OUTCOME_BYTES,
        "marker": marker,
    }
    return "exec python3 -I -S -B -c " + shlex.quote(_PROGRAM), json.dumps(spec) + "\n", marker


def parse(output: str, marker: str, count: int) -> list[dict]:
    """The `count` outcomes of the reply after `marker` (the last such line), each checked to
    decode; ReplayError when there is none or anything about it is malformed."""
    lines = [line for line in output.splitlines() if line.startswith(marker + " ")]
    if not lines:
        raise ReplayError("no replay reply")
    try:
        reply = json.loads(lines[-1][len(marker) + 1 :])
    except ValueError:
        raise ReplayError("the replay reply is not JSON") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("outcomes"), list):
        error = reply.get("error") if isinstance(reply, dict) else None
        raise ReplayError(f"the replay gave no outcomes: {str(error)[:300]}")
    outcomes = reply["outcomes"]
    if len(outcomes) != count:
        raise ReplayError("the replay reply has the wrong number of outcomes")
    for outcome in outcomes:
        decode_outcome(outcome)
    return outcomes


def decode_outcome(data) -> dict:
    """An outcome with its values decoded, every tag and shape checked (ReplayError else)."""
    try:
        if not isinstance(data, dict) or set(data) != {"result", "args_after"}:
            raise ValueError("malformed outcome")
        after = data["args_after"]
        return {
            "result": _decode_result(data["result"]),
            "args_after": None if after is None else harness.decode(after),
        }
    except (ValueError, TypeError, KeyError, IndexError, RecursionError) as error:
        raise ReplayError(f"malformed outcome: {error}") from None


def _decode_result(result) -> tuple:
    if not isinstance(result, list) or not result or result[0] not in _TAGS:
        raise ValueError("malformed result")
    tag, rest = result[0], result[1:]
    if tag == "value" and len(rest) == 1:
        return ("value", harness.decode(rest[0]))
    if tag == "iter" and len(rest) == 2 and isinstance(rest[0], list):
        items = tuple(harness.decode(item) for item in rest[0])
        end = rest[1]
        if end in ("end", "more"):
            return ("iter", items, end)
        return ("iter", items, _decode_result(end))
    if tag in ("raise", "opaque", "unresolved") and len(rest) == 1 and isinstance(rest[0], str):
        return (tag, rest[0])
    if tag == "timeout" and not rest:
        return ("timeout",)
    raise ValueError(f"malformed {tag!r} result")


def same(got: dict, want: dict) -> bool:
    """Whether an outcome (as `parse` returns it) equals the expected one, exact types
    throughout (a set's order does not count)."""
    got, want = decode_outcome(got), decode_outcome(want)
    return _same(got["result"], want["result"]) and (
        want["args_after"] is None or _same(got["args_after"], want["args_after"])
    )


def _same(got, want) -> bool:
    if type(want) is tuple and want and want[0] in _TAGS:  # a decoded result
        if type(got) is not tuple or len(got) != len(want) or got[0] != want[0]:
            return False
        return all(_same(a, b) for a, b in zip(got[1:], want[1:]))
    if type(want) is tuple and type(got) is tuple:  # iterator items
        return len(got) == len(want) and all(harness.same(a, b) for a, b in zip(got, want))
    return harness.same(got, want)


def replayable(call: dict, outcome: dict) -> bool:
    """Whether the original's outcome of a call (both as stored) can be expected of a
    candidate: not an object without a plain-data form, a timeout or an input that did not
    resolve, and something observable (a body that does nothing would not return None and
    leave the arguments as they were)."""
    result = outcome["result"]
    if result[0] in ("opaque", "timeout", "unresolved"):
        return False
    return not (result == ["value", ["none"]] and outcome["args_after"] == call["input"])


def value_tests(replay: dict) -> set[str]:
    """The tests that check a value: one of their recorded calls does not end in an exception
    before giving anything (a generator raising at its first item counts as raising). A body
    that raises whatever it is given passes the others (an input check alone)."""
    return {
        call["test"]
        for call, want in zip(replay["calls"], replay["expected"])
        if not _raises_at_once(want["result"])
    }


def _raises_at_once(result: list) -> bool:
    if result[0] == "iter":
        items, end = result[1], result[2]
        return not items and isinstance(end, list) and end[:1] == ["raise"]
    return result[0] == "raise"


def matches(replay: dict, outcomes: list[dict] | None) -> list[bool]:
    """Per recorded call, whether its replayed outcome equals the expected one (`outcomes`
    None: the replay gave nothing, so none does)."""
    if outcomes is None:
        return [False] * len(replay["calls"])
    return [same(got, want) for got, want in zip(outcomes, replay["expected"])]
