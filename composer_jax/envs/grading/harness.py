"""The grading harness: the only program that sees a task's expected answers.

It runs inside the sandbox as `python3 -I -B -c <this source>`, its input (the expected answers
and a random nonce) arriving on stdin, so nothing of it exists as a file any other process could
read. It forks one spare child, makes itself non-dumpable (no ptrace, no /proc/<pid>/mem or fd
access for other processes) and only then reads its input; it runs the code under test in child
processes that never hold the answers (that spare, or a fresh interpreter after a child died),
exchanging plain data with them over pipes, and prints exactly one verdict line, prefixed
by the nonce. The grader trusts that line only: text a candidate prints, an exit at import,
objects with a forged `__eq__` (every value crosses the pipe as tagged plain data and is compared
by exact type), patched library functions in its own process, or another sample's files cannot
produce it.

Kinds of grading:
- `cases`: call `module.function(*args)` per case, compare with the expected value (exact types).
- `check`: a HumanEval-style `check(candidate)` runs here, after the task's trusted prelude (its
  prompt: helper functions the check uses); `candidate` forwards each call to the child.
- `file`: compare a workspace file with the expected text (nothing of the candidate runs):
  test "exact", plus a similarity score in [0, 1] (difflib's ratio of lines).
- `pytest`: a repository's own tests in a fresh guarded runner (`_repo_runner`, source in the
  spec) on a tree of pristine tests plus the candidate's modules (`repo_grading`). The tests
  share the candidate's process, so their verdict only gates the reward: the reward itself is
  the share of the recorded calls (`replay`) the candidate's function answers exactly.

Standard library only: this file is shipped as source text.
"""

import ctypes
import json
import math
import os
import secrets
import select
import signal
import sys
import threading
import time

_MAX_REPLY = 16 << 20


# ----------------------------------------------------------------------------- plain data codec
# Shared with the child processes as source (this file itself reaches the sandbox as text).
_CODEC = r'''
import math

_MAX_DEPTH = 64
_MAX_ITEMS = 200_000

def encode(value, depth=0, ref=None):
    """Tagged plain data ([tag, payload]) for JSON; exact types, so a str subclass or an object
    with a custom __eq__ never crosses as itself. Raises TypeError for anything else, except
    what `ref` names (["ref", ref(value)]; it raises TypeError for what it cannot name)."""
    if depth > _MAX_DEPTH:
        raise TypeError("value nested too deeply")
    kind = type(value)
    if value is None:
        return ["none"]
    if kind is bool:
        return ["bool", value]
    if isinstance(value, bool):
        return ["bool", bool.__bool__(value)]
    if isinstance(value, int):
        return ["int", int.__index__(value)]
    if isinstance(value, float):
        return ["float", float.hex(float.__float__(value))]
    if isinstance(value, complex):
        value = complex.__complex__(value)
        return ["complex", [float.hex(value.real), float.hex(value.imag)]]
    if isinstance(value, str):
        return ["str", str.__str__(value)]
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", bytes(value).hex()]
    for base, tag in ((list, "list"), (tuple, "tuple"), (set, "set"), (frozenset, "frozenset")):
        if isinstance(value, base):
            items = list(base.__iter__(value))
            return [tag, [encode(item, depth + 1, ref) for item in items]]
    if isinstance(value, dict):
        pairs = dict.items(value)
        return ["dict", [[encode(k, depth + 1, ref), encode(v, depth + 1, ref)] for k, v in pairs]]
    if ref is not None:
        return ["ref", ref(value)]
    raise TypeError(f"a {kind.__name__} is not plain data")


def decode(data, depth=0, budget=None, resolve=None):
    """The value of `encode`'s output, validating every tag and shape (ValueError otherwise); a
    "ref" is accepted only where `resolve` turns it into its object (never on the host)."""
    budget = budget if budget is not None else [_MAX_ITEMS]
    budget[0] -= 1
    if depth > _MAX_DEPTH or budget[0] < 0:
        raise ValueError("value too large or nested too deeply")
    if not isinstance(data, list) or not data or not isinstance(data[0], str):
        raise ValueError("malformed value")
    tag, rest = data[0], data[1:]
    if tag == "none" and not rest:
        return None
    if len(rest) != 1:
        raise ValueError(f"malformed {tag!r} value")
    payload = rest[0]
    if tag == "bool" and type(payload) is bool:
        return payload
    if tag == "int" and type(payload) is int:
        return payload
    if tag == "float" and type(payload) is str:
        return float.fromhex(payload)
    if tag == "complex" and type(payload) is list and len(payload) == 2:
        return complex(float.fromhex(payload[0]), float.fromhex(payload[1]))
    if tag == "str" and type(payload) is str:
        return payload
    if tag == "bytes" and type(payload) is str:
        return bytes.fromhex(payload)
    if tag in ("list", "tuple", "set", "frozenset") and type(payload) is list:
        items = [decode(item, depth + 1, budget, resolve) for item in payload]
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    if tag == "dict" and type(payload) is list:
        out = {}
        for pair in payload:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("malformed dict item")
            key = decode(pair[0], depth + 1, budget, resolve)
            out[key] = decode(pair[1], depth + 1, budget, resolve)
        return out
    if tag == "ref" and resolve is not None:
        return resolve(payload)
    raise ValueError(f"malformed {tag!r} value")
'''
CODEC_SOURCE = _CODEC  # for programs that run the codec in a process of their own (`replay`)
_codec: dict = {}
exec(_CODEC, _codec)  # noqa: S102 -- encode / decode here, from the one source the children get
encode, decode = _codec["encode"], _codec["decode"]


def same(got, want) -> bool:
    """Equality of plain data with exact types (True is not 1, 2.0 is not 2), set items and
    dict keys included; NaN equals NaN."""
    if type(got) is not type(want):
        return False
    if type(want) is float:
        return got == want or (math.isnan(got) and math.isnan(want))
    if type(want) in (list, tuple):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want))
    if type(want) in (set, frozenset):  # Python's == takes {1} for {1.0} and {True}
        return sorted(map(_exact, got)) == sorted(map(_exact, want))
    if type(want) is dict:
        got_keys, want_keys = {_exact(k): k for k in got}, {_exact(k): k for k in want}
        return got_keys.keys() == want_keys.keys() and all(
            same(got[got_keys[key]], want[want_keys[key]]) for key in want_keys
        )
    return got == want


def _exact(value) -> str:
    """Plain data as text that tells types apart: how set items and dict keys are compared."""
    return json.dumps(encode(value))


# ------------------------------------------------------------------------- the child processes
# A child serves calls of one function: a request line {"args": [...]} in, a reply line out, on
# a private copy of its stdout (what the candidate prints goes to stderr).
_CALL_CHILD = r"""
import importlib, json, os, sys
reply = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.path.insert(0, os.getcwd())
CODEC
spec = json.loads(sys.stdin.readline())
try:
    function = getattr(importlib.import_module(spec["module"]), spec["function"])
    ready = {"ok": True}
except BaseException as error:
    function, ready = None, {"ok": False, "error": f"import: {type(error).__name__}: {error}"}
reply.write(json.dumps(ready) + "\n")
reply.flush()
for line in sys.stdin:
    try:
        args = [decode(a) for a in json.loads(line)["args"]]
        out = {"ok": True, "value": encode(function(*args))}
    except BaseException as error:
        out = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:200]}"}
    reply.write(json.dumps(out) + "\n")
    reply.flush()
"""


class CandidateError(Exception):
    """The code under test raised, crashed, timed out or answered something that is not data."""


# The child programs by name, codec included (a spawned child gets the text, the spare the name).
_PROGRAMS = {"call": _CALL_CHILD.replace("CODEC", _CODEC)}


class _ChildProcess:
    """A child's pid and the parent's ends of its stdin, stdout and stderr pipes: the part of
    `subprocess.Popen` the harness uses. Importing subprocess costs about 11 ms of every
    grading's start, more than the rest of the harness's imports together."""

    def __init__(self, pid: int, stdin: int, stdout: int, stderr: int):
        self.pid = pid
        self.stdin = os.fdopen(stdin, "wb")
        self.stdout = os.fdopen(stdout, "rb")
        self.stderr = os.fdopen(stderr, "rb")
        self.returncode = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:  # not reaped yet, so the pid is still this child's
            os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _pipes() -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(the child's stdin, stdout, stderr fds; the parent's ends of the same three pipes)."""
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    stderr_r, stderr_w = os.pipe()
    return (stdin_r, stdout_w, stderr_w), (stdin_w, stdout_r, stderr_r)


def _spawn(argv: list[str], env: dict) -> _ChildProcess:
    """A fresh process running `argv` (pipes made inheritable only as its 0, 1, 2; every other
    descriptor is close-on-exec)."""
    theirs, ours = _pipes()
    actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(theirs)]
    pid = os.posix_spawn(argv[0], argv, env, file_actions=actions)
    for fd in theirs:
        os.close(fd)
    return _ChildProcess(pid, *ours)


def _fork_spare() -> _ChildProcess:
    """A child forked before this process has read its input, so it holds no answer, no nonce
    and none of the harness's descriptors but its own pipes. It waits for the name of the
    program to run, and saves the interpreter start and imports that a fresh child would pay
    in every grading."""
    theirs, ours = _pipes()
    pid = os.fork()
    if pid == 0:
        try:
            for target, fd in enumerate(theirs):
                os.dup2(fd, target)  # replaces the unread input and the verdict channel
            os.closerange(3, 1024)  # the pipes' other ends (the harness opens nothing else)
            _run_spare()
        finally:
            os._exit(0)  # never return into the harness's own code
    for fd in theirs:
        os.close(fd)
    return _ChildProcess(pid, *ours)


def _run_spare() -> None:
    """In the spare child: run the named program as a fresh `__main__`, as a spawned one would."""
    program = _PROGRAMS.get(sys.stdin.readline().strip())
    if program is None:
        return
    main_module = type(sys)("__main__")
    sys.modules["__main__"] = main_module
    try:
        exec(compile(program, "<child>", "exec"), main_module.__dict__)  # noqa: S102
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: S110 -- what the candidate left of them, best effort
                pass


_spare: _ChildProcess | None = None


def _start(name: str) -> _ChildProcess:
    """A child running program `name`: the spare while it is unused and alive, else a fresh
    interpreter (after a child crashed or timed out)."""
    global _spare
    process, _spare = _spare, None
    if process is not None and process.poll() is None:
        try:
            process.stdin.write(name.encode() + b"\n")
            process.stdin.flush()
            return process
        except OSError:
            process.kill()
            process.wait()
    return _spawn([sys.executable, "-I", "-B", "-c", _PROGRAMS[name]], dict(os.environ))


class Child:
    """A child interpreter running program `name` (with the codec), talking JSON lines."""

    def __init__(self, name: str, first_message: dict, seconds: float):
        self.seconds = seconds
        self.log = bytearray()
        self.process = _start(name)
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        self._buffer = b""
        self.send(first_message)

    def _drain_stderr(self):
        for chunk in iter(lambda: self.process.stderr.read1(65536), b""):
            self.log += chunk
            del self.log[: max(0, len(self.log) - 4000)]

    def send(self, message: dict) -> None:
        try:
            self.process.stdin.write((json.dumps(message) + "\n").encode())
            self.process.stdin.flush()
        except OSError:
            pass

    def receive(self, seconds: float | None = None) -> dict:
        deadline = time.monotonic() + (seconds or self.seconds)
        out = self.process.stdout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                raise CandidateError("timed out")
            ready, _, _ = select.select([out], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(out.fileno(), 65536)
            if not chunk:
                raise CandidateError(f"exited ({self.process.poll()})")
            self._buffer += chunk
            if len(self._buffer) > _MAX_REPLY:
                self.close()
                raise CandidateError("reply too large")
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            raise CandidateError("garbled reply") from None
        if not isinstance(message, dict):
            raise CandidateError("garbled reply")
        return message

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


class Candidate:
    """The function under test, called in a child process; a call returns plain data."""

    def __init__(self, module: str, function: str, seconds: float):
        self.target = {"module": module, "function": function}
        self.seconds = seconds
        self.child = None

    def _ready_child(self) -> Child:
        if self.child is None or self.child.process.poll() is not None:
            self.child = Child("call", self.target, self.seconds)
            ready = self.child.receive()
            if not ready.get("ok"):
                raise CandidateError(str(ready.get("error")))
        return self.child

    def __call__(self, *args):
        child = self._ready_child()
        child.send({"args": [encode(a) for a in args]})
        try:
            reply = child.receive()
        except CandidateError:
            self.child = None
            raise
        if reply.get("ok") is not True:
            raise CandidateError(str(reply.get("error")))
        try:
            return decode(reply.get("value"))
        except ValueError as error:
            raise CandidateError(str(error)) from None

    def close(self) -> None:
        if self.child is not None:
            self.child.close()


# ---------------------------------------------------------------------------------- the kinds
def grade_cases(spec: dict) -> dict:
    candidate = Candidate(spec["module"], spec["function"], spec.get("call_seconds", 10.0))
    outcomes = {}
    try:
        for i, (args, want) in enumerate(spec["cases"]):
            name = f"case_{i}"
            try:
                got = candidate(*[decode(a) for a in args])
                outcomes[name] = "pass" if same(got, decode(want)) else "fail"
            except CandidateError:
                outcomes[name] = "error"
    finally:
        candidate.close()
    return outcomes


def grade_check(spec: dict) -> dict:
    candidate = Candidate(spec["module"], spec["function"], spec.get("call_seconds", 10.0))
    namespace = {"__name__": "cj_check"}
    try:
        exec(compile(spec.get("prelude", ""), "<prelude>", "exec"), namespace)
        namespace[spec["function"]] = candidate  # a check may call the function by its name
        exec(compile(spec["check"], "<check>", "exec"), namespace)
        namespace[spec.get("check_function", "check")](candidate)
        outcome = "pass"
    except CandidateError:
        outcome = "error"
    except BaseException:
        outcome = "fail"
    finally:
        candidate.close()
    return {spec.get("test_name", "check"): outcome}


# The repository runner (`_repo_runner`, its source in the spec) runs in an interpreter without
# site directories, so nothing planted in the workspace is imported before it. Its globals are
# a dict of their own, held by no module and no global name: the candidate's code runs in the
# same process, and `vars(sys.modules["__main__"])[name] = ...` is a plain store that no audit
# event reports (rebinding the runner's writer or its audit tables forged the verdict).
RUNNER_BOOT = (
    "import json, sys\n"
    "(lambda settings, namespace: (\n"
    "    exec(compile(settings.pop('runner'), '<runner>', 'exec'), namespace),\n"
    "    namespace['main'](settings),\n"
    "))(json.loads(sys.stdin.readline()), {'__name__': '__main__'})\n"
)


def _read_until_exit(process: _ChildProcess, seconds: float) -> bytes | None:
    """Everything the child writes on its stdout until it closes it, or None past `seconds`."""
    deadline, data = time.monotonic() + seconds, bytearray()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or len(data) > _MAX_REPLY:
            return None
        ready, _, _ = select.select([process.stdout], [], [], remaining)
        if ready:
            chunk = os.read(process.stdout.fileno(), 65536)
            if not chunk:
                return bytes(data)
            data += chunk


def grade_pytest(spec: dict) -> tuple[dict, dict]:
    """The repository's own tests, in a fresh runner; its verdict counts only when it is the one
    message of a child that exited 0, names only the selected tests and found nothing tampered
    with (else no test passed)."""
    argv = [sys.executable, "-I", "-S", "-B", "-X", f"pycache_prefix={spec['pycache']}"]
    process = _spawn([*argv, "-c", RUNNER_BOOT], {"HOME": "/tmp"})
    log = bytearray()
    drain = threading.Thread(target=lambda: log.extend(process.stderr.read()), daemon=True)
    drain.start()
    wanted = list(spec["select"])
    nonce = secrets.token_hex(16)  # the verdict must carry it: a line the candidate wrote cannot
    settings = {key: spec[key] for key in ("runner", "root", "lib", "paths", "ini", "tmp")}
    settings.update(mode="grade", select=wanted, candidate_files=spec["candidate_files"])
    settings["nonce"] = nonce
    try:
        process.stdin.write((json.dumps(settings) + "\n").encode())
        process.stdin.close()
    except OSError:
        pass
    data = _read_until_exit(process, spec.get("suite_seconds", 120.0))
    process.kill()
    status = process.wait()
    drain.join(1.0)
    sys.stderr.write(log[-4000:].decode("utf-8", "replace"))  # the log, never the verdict
    verdict = _runner_verdict(data, status, wanted, nonce)
    if verdict is None or verdict["tampered"]:
        return {test: "fail" for test in wanted}, {"tampered" if verdict else "runner_void": 1.0}
    outcomes = {test: str(verdict["tests"].get(test, "missing")) for test in wanted}
    return outcomes, {"blocked": len(verdict["blocked"]), "collection_errors": verdict["errors"]}


def _runner_verdict(data: bytes | None, status: int, wanted: list[str], nonce: str) -> dict | None:
    """The verdict if it is the well-formed only message of a child that exited 0 and carries
    the run's nonce (else None)."""
    lines = (data or b"").splitlines()
    if data is None or status != 0 or len(lines) != 1:
        return None
    try:
        verdict = json.loads(lines[0])
        ok = isinstance(verdict["tests"], dict) and not set(verdict["tests"]) - set(wanted)
        ok = ok and verdict["nonce"] == nonce
        return {**verdict, "errors": len(verdict["errors"])} if ok else None
    except (ValueError, KeyError, TypeError):
        return None


def grade_file(spec: dict) -> tuple[dict, dict]:
    import difflib

    try:
        with open(spec["path"], encoding="utf-8", errors="replace") as f:
            got = f.read(_MAX_REPLY)
    except OSError:
        return {"exact": "fail"}, {"similarity": 0.0}
    want = spec["expected"]
    similarity = difflib.SequenceMatcher(
        None, got.splitlines(), want.splitlines(), autojunk=False
    ).ratio()
    return {"exact": "pass" if got == want else "fail"}, {"similarity": similarity}


_KINDS = {
    "cases": grade_cases,
    "check": grade_check,
    "file": grade_file,
    "pytest": grade_pytest,
}


def _no_dump() -> None:
    """No other process of this user may read this one's memory or descriptors."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except (OSError, AttributeError):
        pass


def main() -> None:
    """Grades the spec on stdin and prints the verdict line (see the module docstring)."""
    global _spare
    # Forked before this process turns non-dumpable, so the code under test may read its own
    # /proc/self as it could in a fresh interpreter; it runs only once the input is read, after
    # this process has made itself unreadable.
    _spare = _fork_spare()
    _no_dump()
    try:
        spec = json.loads(sys.stdin.read())
        graded = _KINDS[spec["kind"]](spec)
    finally:
        if _spare is not None:  # unused (a `file` grading): end it
            _spare.kill()
            _spare.wait()
    outcomes, scores = graded if isinstance(graded, tuple) else (graded, {})
    verdict = json.dumps({"tests": outcomes, "scores": scores})
    sys.stdout.write(f"\n{spec['nonce']} {verdict}\n")
    sys.stdout.flush()
