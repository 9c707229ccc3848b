"""The runner of a repository's own tests (pytest), in a fresh interpreter the grader spawns.

It is shipped as source text (standard library plus the pytest that the grading binds read-only)
and run as `python -I -S -B -c <this file>` with its settings on stdin, so no `PYTHONPATH`, site
directory, `.pth` file, `sitecustomize` / `usercustomize` or bytecode cache of the candidate's
takes part. The test files, conftests and pytest settings it runs come from a tree the grader
assembled from the task's pristine files; only the package's source modules come from the
candidate's workspace.

The candidate's code runs in this process (the tests call it), so in `grade` mode the runner
guards what decides the verdict before any repository code is imported:
- every class of the test machinery (pytest, pluggy, unittest; but one debugger class pytest
  itself assigns to) is made an immutable type, and the modules of unittest, pluggy,
  `builtins` and this program refuse attribute assignment;
- the machinery's functions and classes (and their code objects) are snapshotted and checked
  after every test phase, as are its `sys.modules` entries (pytest's own modules set each
  other's attributes while running, so they are covered by the check, not made read-only);
- an audit hook refuses, to code that is not the stdlib's, pytest's or the pristine tests', frame
  and garbage-collector introspection, ctypes, new processes, signals to processes, tracing
  hooks, new code objects, re-opening file descriptors and writes outside /tmp; each refusal is
  recorded. Code counts as a trusted file's only when it is what that file compiles to: a code
  object's file name can be forged without an audited event (`marshal.loads` of crafted bytes,
  `_imp._fix_co_filename`);
- the verdict is one JSON line on a descriptor duplicated before the tests ran, after which this
  process ends through a reference taken at start (`atexit` hooks and finalizers never run);
  it carries a nonce the harness sent on stdin, which `main` takes into its frame before any
  repository code runs (a line the candidate writes to the descriptor and then exits cannot
  carry it; reading a process's memory is refused). The harness runs this program in globals
  no module holds (`harness.RUNNER_BOOT`), so its names cannot be rebound from outside.
The grader accepts the verdict only as the single message of a child that exited 0 and checks it
against the nonce and the exact expected test ids; anything else (a second message, a crash, a
timeout, a tampered snapshot) grades as nothing passed.

In `survey` mode (the task factory, on the original code) it records which source functions each
test calls, through `sys.monitoring`; in `record` mode, the arguments of every call the tests
make to one function (the inputs replay grading calls it on, see `replay`); in `collect` mode
(the trusted warm-up of a grading slot) it only collects, writing the tests' bytecode to the
cache.
"""

import _imp
import importlib
import json
import os
import pathlib
import re
import sys
import types

_EXIT = os._exit
_WRITE = os.write
_FSTAT = os.fstat
_DUMPS = json.dumps
_PROTECTED = ("_pytest", "pytest", "pluggy", "iniconfig", "unittest", "builtins", "__main__")
# Modules made read-only (pytest's own set each other's attributes while it runs, so those are
# covered by the snapshot instead), and classes pytest itself assigns to while it runs.
_READ_ONLY = ("unittest", "pluggy", "builtins", "__main__")
_MUTATED_BY_PYTEST = {"pytestPDB"}
_BLOCKED_EVENTS = (
    "sys._getframe",
    "sys._current_frames",
    "sys._current_exceptions",
    "sys.settrace",
    "sys.setprofile",
    "sys.monitoring.register_callback",
    "gc.get_objects",
    "gc.get_referrers",
    "gc.get_referents",
    "os.fork",
    "os.forkpty",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.system",
    "subprocess.Popen",
    "pty.spawn",
    "os.kill",
    "os.killpg",
    "signal.pthread_kill",
    "code.__new__",
)
_FRAME_ATTRIBUTES = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_locals"}
_STDLIB = os.path.dirname(os.__file__) + "/"
# Frozen modules whose code names a file other than the module (`<frozen importlib._bootstrap>`).
_FROZEN_ALIASES = {
    "importlib._bootstrap": "_frozen_importlib",
    "importlib._bootstrap_external": "_frozen_importlib_external",
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# A process's memory, and the folders a memory file can be opened relative to (`dir_fd`, which
# the open event does not carry): /proc itself, a process's, a thread's, its mapped files.
_PROCESS_MEMORY = re.compile(
    r"/proc(/(\d+|self|thread-self)(/task(/\d+)?)?(/(mem|map_files(/.*)?))?)?"
)
_MEMORY_NAMES = ("mem", "map_files")


def _process_memory(path) -> bool:
    """Whether opening `path` could read a process's memory (which holds the verdict's nonce):
    it is, its links followed, a memory file or a folder one can be opened from, or it is named
    like one (opened relative to such a folder); a path that cannot be resolved counts too."""
    try:
        text = os.fsdecode(path)
        if os.path.basename(text.rstrip("/")) in _MEMORY_NAMES:
            return True
        return bool(_PROCESS_MEMORY.fullmatch(os.path.realpath(text)))
    except (OSError, ValueError):
        return True


def _protected(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in _PROTECTED)


class _ReadOnlyModule(types.ModuleType):
    """A module of the test machinery during grading: no attribute may be set or deleted."""

    def __setattr__(self, name, value):
        raise AttributeError(f"module {self.__name__!r} is read-only while tests are graded")

    def __delattr__(self, name):
        raise AttributeError(f"module {self.__name__!r} is read-only while tests are graded")


_IMMUTABLE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE


def _type_flags(cls: type, ctypes):
    """The tp_flags word of a heap type, found by checking it against `cls.__flags__`."""
    offset = 21 * ctypes.sizeof(ctypes.c_void_p)  # PyTypeObject.tp_flags
    flags = ctypes.c_ulong.from_address(id(cls) + offset)
    return flags if flags.value == cls.__flags__ else None


def _code_tree(roots) -> list:
    """Every code object in `roots` and nested in their constants."""
    found, stack = [], list(roots)
    while stack:
        code = stack.pop()
        found.append(code)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return found


def _fingerprint(code: types.CodeType) -> tuple:
    """What a code object does (bytecode, exception table, names, constants, signature) and
    where it stands in its file; nested code objects count by their own fingerprints."""
    consts = tuple(map(_constant_key, code.co_consts))
    return (
        code.co_qualname,
        code.co_firstlineno,
        code.co_code,
        code.co_exceptiontable,
        code.co_flags,
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_cellvars,
        (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount),
        consts,
    )


def _constant_key(value) -> tuple:
    """A constant as its type and value all the way down (so `-0.0` is not `0.0`, `True` not
    `1`, and NaN equals NaN); a nested code object by its name and line."""
    if isinstance(value, types.CodeType):
        return ("code", value.co_qualname, value.co_firstlineno)
    if isinstance(value, tuple):
        return (tuple, tuple(map(_constant_key, value)))
    if isinstance(value, frozenset):
        return (frozenset, frozenset(map(_constant_key, value)))
    if isinstance(value, (float, complex)):
        return (type(value), repr(value))
    return (type(value), value)  # a constant that cannot be hashed raises TypeError


def _runner_code() -> list:
    """The code objects of this program's own functions and classes (it is run from source as
    `<runner>`, so no file holds it): taken before any repository code runs."""
    roots = []
    for value in list(globals().values()):
        members = vars(value).values() if isinstance(value, type) else (value,)
        for member in members:
            member = getattr(member, "__func__", member)  # static and class methods
            code = getattr(member, "__code__", None)
            if isinstance(code, types.CodeType) and code.co_filename == "<runner>":
                roots.append(code)
    return _code_tree(roots)


class Guard:
    """The defences of `grade` mode (see the module docstring). Trusted code: this program, the
    stdlib, the bound libraries, and the pristine files of the grading tree (not the
    candidate's modules)."""

    def __init__(self, root: str, libraries: list[str], candidate_files: list[str]):
        self.trusted_roots = (root.rstrip("/") + "/", *libraries)
        self.candidate_files = frozenset(candidate_files)
        # file name -> fingerprints of what the file compiles to; id(code) -> (code, the file
        # name it was judged under, verdict)
        self._references = {"<runner>": frozenset(map(_fingerprint, _runner_code()))}
        self._genuine_code: dict = {}
        self._rewrite = None  # pytest's assertion rewriting, taken at install
        self.blocked: list[str] = []
        self.snapshot: dict = {}
        self._busy = False
        self._frozen: list = []  # the tp_flags words set immutable, cleared by `release`

    def install(self, config) -> None:
        # Imported here: ctypes is dropped from sys.modules once the hook exists (so a later
        # import is an audited event), and pytest is importable only once main set sys.path.
        import ctypes

        from _pytest.assertion.rewrite import _rewrite_test
        from _pytest.nodes import Item

        self._rewrite = lambda path: _rewrite_test(path, config)[1]  # as pytest rewrites

        self._import_machinery()
        modules = [m for n, m in list(sys.modules.items()) if _protected(n)]
        classes = {
            id(value): value
            for module in modules
            for value in list(vars(module).values())
            if isinstance(value, type)
            and _protected(getattr(value, "__module__", "") or "")
            and value.__flags__ & (1 << 9)  # a heap type (static ones are immutable already)
        }
        for cls in classes.values():
            if issubclass(cls, Item):  # a flag pytest sets on an Item class at first use
                cls._pytest_diamond_inheritance_warning_shown = True
        for cls in classes.values():
            if cls.__name__ in _MUTATED_BY_PYTEST:
                continue
            if (flags := _type_flags(cls, ctypes)) is not None:
                flags.value |= _IMMUTABLE
                self._frozen.append(flags)
        for module in modules:
            if type(module) is types.ModuleType and module.__name__.startswith(_READ_ONLY):
                module.__class__ = _ReadOnlyModule
        self.snapshot = self._take()
        for name in [n for n in sys.modules if n.split(".")[0] in ("ctypes", "_ctypes")]:
            del sys.modules[name]  # so that a later `import ctypes` is an audited event
        sys.addaudithook(self._audit)

    @staticmethod
    def _import_machinery() -> None:
        """The machinery a run loads anyway, loaded now so it is guarded from the start."""
        from _pytest.config import default_plugins

        for name in (*(f"_pytest.{p}" for p in default_plugins), "_pytest.python_api"):
            try:
                importlib.import_module(name)
            except ImportError:
                continue
        for name in ("unittest.case", "unittest.suite", "unittest.loader", "unittest.result"):
            importlib.import_module(name)

    def _take(self) -> dict:
        state = {"sys.modules": {n: id(m) for n, m in sys.modules.items() if _protected(n)}}
        for name, module in list(sys.modules.items()):
            if not _protected(name):
                continue
            entries = {}
            for key, value in list(vars(module).items()):
                if isinstance(value, (types.FunctionType, type)):
                    entries[key] = (id(value), id(getattr(value, "__code__", None)))
            state[name] = entries
        return state

    def release(self) -> None:
        """Makes the machinery's classes mutable again once every test has run (pytest's own
        clean-up restores attributes it set at start)."""
        for flags in self._frozen:
            flags.value &= ~_IMMUTABLE
        self._frozen.clear()

    def changes(self) -> list[str]:
        """What of the snapshot differs now (empty when nothing was tampered with)."""
        if not self.snapshot:
            return ["the guard was never installed"]
        found = []
        current_modules = {n: id(m) for n, m in sys.modules.items() if _protected(n)}
        for name, ident in self.snapshot["sys.modules"].items():
            if current_modules.get(name) != ident:
                found.append(f"sys.modules[{name!r}] replaced")
        for name, entries in self.snapshot.items():
            module = sys.modules.get(name)
            if name == "sys.modules" or module is None:
                continue
            namespace = vars(module)
            for key, (ident, code) in entries.items():
                value = namespace.get(key)
                if value is None or (id(value), id(getattr(value, "__code__", None))) != (
                    ident,
                    code,
                ):
                    found.append(f"{name}.{key} replaced")
        return found

    def _untrusted_caller(self) -> str | None:
        """The file of the nearest caller outside the stdlib, when it is not trusted; a frame
        whose code is not what its file compiles to is untrusted wherever it claims to be."""
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            filename = code.co_filename
            if not self._genuine(code):
                return filename
            if filename.startswith(_STDLIB) or filename.startswith("<frozen "):
                frame = frame.f_back
                continue
            return None if self._trusted(filename) else filename
        # Only the stdlib on the stack: a thread the candidate started on a builtin callable.
        # (The main thread's stack starts in the harness's `-c` program, outside the stdlib.)
        return "<no caller outside the stdlib>"

    def _genuine(self, code: types.CodeType) -> bool:
        """Whether `code` is code its file compiles to (the stdlib, frozen modules, the bound
        libraries, the grading tree, this program); candidate files and others are not."""
        filename = code.co_filename
        _, named, verdict = self._genuine_code.get(id(code), (None, None, None))
        if verdict is not None and named == filename:  # code can be renamed in place
            return verdict
        if not (
            filename.startswith(_STDLIB)
            or filename.startswith("<frozen ")
            or self._trusted(filename)
        ):
            return False
        if filename not in self._references:
            compiled = self._compiled(filename)
            if compiled is None:
                return False  # not kept: a later, shallower call may compile it
            self._references[filename] = compiled
        try:
            verdict = _fingerprint(code) in self._references[filename]
        except TypeError:  # a constant no compiler makes (a list, from marshal)
            verdict = False
        # Keyed by identity (code == code compares content, not the file name), the code held
        # so that no id is reused while its verdict stands.
        self._genuine_code[id(code)] = (code, filename, verdict)
        return verdict

    def _compiled(self, filename: str) -> frozenset | None:
        """The fingerprints of what `filename` compiles to: its frozen code, or its source
        compiled plainly and (in the grading tree, where pytest rewrites tests and conftests)
        with pytest's assertion rewriting."""
        try:
            if filename.startswith("<frozen "):
                name = filename[len("<frozen ") : -1]
                name = _FROZEN_ALIASES.get(name, name)
                return frozenset(map(_fingerprint, _code_tree([_imp.get_frozen_object(name)])))
            with open(filename, "rb") as f:
                source = f.read()
            roots = [compile(source, filename, "exec", dont_inherit=True)]
            if filename.startswith(self.trusted_roots[0]):
                roots.append(self._rewrite(pathlib.Path(filename)))
            return frozenset(map(_fingerprint, _code_tree(roots)))
        except RecursionError:  # met deep in a stack: not this file's fault
            return None
        except Exception:  # unreadable, not Python, no such frozen module: nothing vouches
            return frozenset()

    def _trusted(self, filename: str) -> bool:
        if filename in self.candidate_files:
            return False
        return filename == "<runner>" or filename.startswith(self.trusted_roots)

    def _audit(self, event: str, args: tuple) -> None:
        if self._busy or not self._watched(event, args):
            return
        self._busy = True
        try:
            caller = self._untrusted_caller()
        finally:
            self._busy = False
        if caller is not None:
            what = f"{event} from {caller}"
            self.blocked.append(what)
            raise PermissionError(f"not allowed while tests are graded: {what}")

    def _watched(self, event: str, args: tuple) -> bool:
        if event.startswith(_BLOCKED_EVENTS) or event.startswith("ctypes."):
            return True
        if event == "object.__getattr__":
            return args[1] in _FRAME_ATTRIBUTES
        if event in ("object.__setattr__", "object.__delattr__"):
            return _protected(getattr(args[0], "__module__", "") or "")
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or _process_memory(path):
                return True
            writes = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & _WRITE_FLAGS)
            return writes and not os.fsdecode(path).startswith(("/tmp/", "/dev/null"))
        if event == "os.symlink":  # a link to a process's memory, opened relative to its folder
            return "/proc" in os.fsdecode(args[0]) or _process_memory(args[0])
        if event == "compile":  # code posing as a trusted file
            filename = args[1]
            return isinstance(filename, str) and self._trusted(filename)
        if event == "import":
            return args[0].split(".")[0] in ("ctypes", "_ctypes", "_pytest", "pytest", "pluggy")
        return False


class Recorder:
    """The pytest plugin that selects the wanted tests and records each one's outcome."""

    def __init__(self, select, guard: Guard | None, coverage: "Coverage | CallLog | None"):
        self.select = set(select) if select is not None else None
        self.guard = guard
        self.coverage = coverage
        self.outcomes: dict[str, str] = {}
        self.errors: list[str] = []
        self.tampered: list[str] = []

    def pytest_load_initial_conftests(self, early_config, parser, args):
        if self.guard is not None:  # before the first conftest imports repository code
            self.guard.install(early_config)

    def pytest_unconfigure(self, config):
        if self.guard is not None:
            self.tampered.extend(self.guard.changes())
            self.guard.release()

    def pytest_collection_modifyitems(self, session, config, items):
        if self.select is not None:
            items[:] = [item for item in items if item.nodeid in self.select]

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(report.nodeid)

    def pytest_runtest_setup(self, item):
        if self.coverage is not None:
            self.coverage.begin(item.nodeid)

    def pytest_runtest_logreport(self, report):
        if self.guard is not None and (changed := self.guard.changes()):
            self.tampered.extend(changed)
        previous = self.outcomes.get(report.nodeid)
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = report.outcome
            if hasattr(report, "wasxfail"):
                outcome = "xfail" if report.skipped else "failed"
            self.outcomes[report.nodeid] = {"passed": "pass", "skipped": "skip"}.get(
                outcome, "fail" if report.when == "call" else "error"
            )
        elif report.when == "teardown" and report.failed and previous == "pass":
            self.outcomes[report.nodeid] = "error"


class Coverage:
    """Which functions of the traced files each test calls (`sys.monitoring` PY_START)."""

    def __init__(self, files: list[str]):
        self.files = set(files)
        self.calls: dict[str, set[str]] = {}
        self.current: set[str] | None = None
        monitoring = sys.monitoring
        monitoring.use_tool_id(3, "composer_jax")
        monitoring.register_callback(3, monitoring.events.PY_START, self._on_start)
        monitoring.set_events(3, monitoring.events.PY_START)

    def _on_start(self, code, offset):
        if code.co_filename not in self.files:
            return sys.monitoring.DISABLE
        if self.current is not None:
            self.current.add(f"{code.co_filename}:{code.co_qualname}")
        return None

    def begin(self, nodeid: str) -> None:
        self.current = self.calls.setdefault(nodeid, set())


class CallLog:
    """The calls the tests make to one function (`record` mode): each outermost call's
    arguments as the codec's plain data, encoded at the call's start (before the function can
    mutate them); a call whose arguments are not plain data is counted, not kept. Arguments
    that are the function's own default object are left out, so the replay uses the default
    (sentinels such as `object()` are not plain data)."""

    def __init__(self, root: str, target: list, codec: dict, max_calls: int, max_bytes: int):
        self.root = root.rstrip("/")
        self.file, self.qualname = target
        self.encode = codec["encode"]
        self.max_calls, self.max_bytes = max_calls, max_bytes
        self.calls: dict[str, list] = {}
        self.opaque: dict[str, int] = {}
        self.current: str | None = None
        monitoring = sys.monitoring
        monitoring.use_tool_id(4, "composer_jax_calls")
        monitoring.register_callback(4, monitoring.events.PY_START, self._on_start)
        monitoring.set_events(4, monitoring.events.PY_START)

    def begin(self, nodeid: str) -> None:
        self.current = nodeid
        self.calls.setdefault(nodeid, [])
        self.opaque.setdefault(nodeid, 0)

    def _on_start(self, code, offset):
        if code.co_filename != self.file or code.co_qualname != self.qualname:
            return sys.monitoring.DISABLE
        frame = sys._getframe(1)
        outer = frame.f_back
        while outer is not None:  # a recursive call is part of the outermost one
            if outer.f_code is code:
                return None
            outer = outer.f_back
        if self.current is None or len(self.calls[self.current]) >= self.max_calls:
            return None
        try:
            record = self.encode(list(_arguments(frame, code)), ref=self._name)
        except (TypeError, KeyError, RecursionError):
            self.opaque[self.current] += 1
            return None
        if len(_DUMPS(record)) > self.max_bytes:
            self.opaque[self.current] += 1
        else:
            self.calls[self.current].append(record)
        return None

    def _name(self, value) -> list:
        """[module, qualname, import root] of a function or class that importing its module
        finds again (a builtin, the package's, a test module's); the import root is relative to
        the tree (None outside it). TypeError for anything else (a lambda, a partial...)."""
        module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
        if type(module) is not str or type(qualname) is not str or "<" in qualname:
            raise TypeError(f"a {type(value).__name__} without an importable name")
        found = owner = sys.modules.get(module)
        for part in qualname.split("."):
            found = getattr(found, part, None)
        if found is not value:
            raise TypeError(f"{module}.{qualname} is not importable as itself")
        file = getattr(owner, "__file__", None) or ""
        if not file.startswith(self.root + "/"):
            return [module, qualname, None]
        base = os.path.dirname(file)
        for _ in range(module.count(".") + (os.path.basename(file) == "__init__.py")):
            base = os.path.dirname(base)
        return [module, qualname, os.path.relpath(base, self.root)]


_CO_VARARGS, _CO_VARKEYWORDS = 0x04, 0x08


def _arguments(frame, code) -> tuple[list, dict]:
    """(positional, keyword) arguments of a call from its frame at the call's start."""
    names, values = code.co_varnames, frame.f_locals
    count, kw_count = code.co_argcount, code.co_kwonlyargcount
    defaults = _defaults(frame, code)
    args, kwargs, by_keyword = [], {}, False
    for name in names[:count]:
        if name in defaults and values[name] is defaults[name]:
            by_keyword = True  # a later argument can no longer go by position
        elif by_keyword:
            kwargs[name] = values[name]
        else:
            args.append(values[name])
    for name in names[count : count + kw_count]:
        if not (name in defaults and values[name] is defaults[name]):
            kwargs[name] = values[name]
    index = count + kw_count
    if code.co_flags & _CO_VARARGS:
        if by_keyword and values[names[index]]:
            raise TypeError("extra positional arguments after a default")
        args.extend(values[names[index]])
        index += 1
    if code.co_flags & _CO_VARKEYWORDS:
        kwargs.update(values[names[index]])
    return args, kwargs


def _defaults(frame, code) -> dict:
    """{parameter: default object} of the function whose code runs in `frame` (found through
    its module's namespace, decorators unwrapped); empty when it cannot be found."""
    parts = code.co_qualname.split(".")
    function = frame.f_globals.get(parts[0])
    for part in parts[1:]:
        function = vars(function).get(part) if isinstance(function, type) else None
    while function is not None and getattr(function, "__code__", None) is not code:
        function = getattr(function, "__wrapped__", None) or getattr(function, "__func__", None)
    if function is None:
        return {}
    positional = code.co_varnames[: code.co_argcount]
    found = dict(
        zip(
            positional[len(positional) - len(function.__defaults__ or ()) :],
            function.__defaults__ or (),
        )
    )
    found.update(function.__kwdefaults__ or {})
    return found


def _report_channel() -> tuple[int, tuple[int, int]]:
    """A private descriptor for the verdict (the pipe on fd 1); fd 1 then goes to stderr."""
    fd = os.dup(1)
    os.dup2(2, 1)
    info = _FSTAT(fd)
    return fd, (info.st_dev, info.st_ino)


def _pytest_args(settings: dict) -> list[str]:
    root = settings["root"]
    ini = settings.get("ini")
    if ini:
        ini = os.path.join(root, ini)
    else:
        ini = os.path.join(settings.get("tmp", "/tmp"), "cj_empty_pytest.ini")
        with open(ini, "w") as f:
            f.write("[pytest]\n")
    return [
        *settings["paths"],
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:pastebin",
        "-p",
        "no:junitxml",
        "-c",
        ini,
        "--rootdir",
        root,
        "--confcutdir",
        root,
        "-o",
        "addopts=",
        "--capture=sys",
        "--import-mode=prepend",
        "--continue-on-collection-errors",
    ]


def main(settings: dict) -> None:
    """Runs the tests `settings` name and writes the verdict (the harness passes the settings
    with this program's source on the first line of stdin)."""
    # Taken into this frame before any repository code runs (its locals are out of reach while
    # frame introspection is refused): the nonce the verdict must carry, and what writes it.
    nonce = settings.pop("nonce", None)
    write, fstat, finish, dumps = _WRITE, _FSTAT, _EXIT, _DUMPS
    fd, channel = _report_channel()
    root = settings["root"]
    sys.path[:0] = [root, *settings.get("lib", [])]
    os.chdir(root)
    sys.dont_write_bytecode = settings["mode"] != "collect"
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    grading = settings["mode"] == "grade"
    guard = None
    if grading:
        guard = Guard(root, settings.get("lib", []), settings.get("candidate_files", []))
    coverage = Coverage(settings["trace_files"]) if settings["mode"] == "survey" else None
    if settings["mode"] == "record":  # the calls the tests make to one function
        codec: dict = {}
        exec(settings["codec"], codec)  # noqa: S102 -- the harness's plain-data codec (source)
        coverage = CallLog(
            root, settings["target"], codec, settings["max_calls"], settings["max_bytes"]
        )
    recorder = Recorder(settings.get("select"), guard, coverage)
    import pytest

    status = None
    arguments = _pytest_args(settings)
    if settings["mode"] == "collect":  # the trusted warm-up: compile the tests, run nothing
        arguments.append("--collect-only")
    try:
        status = int(pytest.main(arguments, plugins=[recorder]))
    except BaseException as error:  # the candidate's SystemExit / KeyboardInterrupt included
        recorder.errors.append(f"runner: {type(error).__name__}: {error}"[:300])
        print(recorder.errors[-1], file=sys.stderr)
    if guard is not None:
        recorder.tampered.extend(guard.changes())
    verdict = {
        "tests": recorder.outcomes,
        "errors": recorder.errors,
        "status": status,
        "tampered": sorted(set(recorder.tampered)),
        "blocked": guard.blocked[:50] if guard is not None else [],
        "nonce": nonce,
    }
    if isinstance(coverage, Coverage):
        verdict["coverage"] = {k: sorted(v) for k, v in coverage.calls.items()}
    elif isinstance(coverage, CallLog):
        verdict["calls"], verdict["opaque_calls"] = coverage.calls, coverage.opaque
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    info = fstat(fd)
    if (info.st_dev, info.st_ino) != channel:
        finish(3)  # the verdict's descriptor was replaced: say nothing, fail
    data = (dumps(verdict) + "\n").encode()
    while data:
        data = data[write(fd, data) :]
    finish(0)
