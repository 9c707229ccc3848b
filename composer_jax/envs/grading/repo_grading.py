"""Grading a repository task with the repository's own tests (grader kind `pytest`).

For each grading the host assembles a fresh tree outside the workspace: every file of the
task's pristine repository except the package's source modules (so tests, conftests and pytest
settings are the task's, whatever the agent did to its copies), plus the agent's versions of the
source modules: `.py` files under the task's source roots only, never a `conftest.py`, a
`*customize.py`, a test file, bytecode or a `.pth`. The sandbox sees that tree, pytest and its
dependencies, and a bytecode cache of the stdlib and pytest (made once per worker by the trusted
interpreter) read-only, at their host paths; the runner (`_repo_runner`) runs there in a fresh
interpreter and the harness reads its verdict (see `harness.grade_pytest`).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from composer_jax.envs.grading import _repo_runner, harness
from composer_jax.envs.sandbox import isolation

# What pytest needs at run time (the distributions a `pip install pytest` brings on 3.12+).
PLANTED_NAMES = ("conftest.py", "sitecustomize.py", "usercustomize.py")
_RUNNER_SOURCE = Path(_repo_runner.__file__).read_text(encoding="utf-8")


class RunnerUnavailable(RuntimeError):
    """pytest is not installed for the grading interpreter to use."""


def _requirements(distribution: str) -> set[str]:
    """`distribution` and what it needs at run time here (markers evaluated, no extras)."""
    needed, todo = set(), [distribution]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in needed:
            continue
        needed.add(name)
        for line in importlib.metadata.requires(name) or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return needed


@functools.cache
def runner_libraries() -> tuple[str, ...]:
    """Host paths of pytest and the packages it needs (from its installed metadata), each a
    package folder or a single module."""
    try:
        needed = _requirements("pytest")
    except importlib.metadata.PackageNotFoundError:
        raise RunnerUnavailable(
            f"grading repository tasks needs pytest (pip install pytest) for {sys.executable}"
        ) from None
    found = set()
    for module, distributions in importlib.metadata.packages_distributions().items():
        if not {canonicalize_name(d) for d in distributions} & needed:
            continue
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin not in (None, "built-in", "frozen"):
            origin = Path(spec.origin)
            found.add(str(origin.parent if origin.name == "__init__.py" else origin))
    return tuple(sorted(found))


def runner_source() -> str:
    return _RUNNER_SOURCE


def installed_copies(import_names, roots=None) -> tuple[str, ...]:
    """Every copy of these packages the sandbox could read, to be masked there so the original
    cannot be read: package folders (vendored ones included: setuptools and pip carry
    more_itertools and idna, SDKs carry their own) and the archives holding one (wheels, zips,
    eggs), anywhere under `roots` (default: the sandbox's read-only system view, all of it, not
    only the interpreter's site-packages)."""
    roots = tuple(isolation.system_roots() if roots is None else roots)
    packages, archives = _python_trees(roots)
    found = [path for name in import_names for path in packages.get(name, ())]
    found += [path for path, names in archives.items() if names & set(import_names)]
    return tuple(sorted(set(found)))


ARCHIVE_SUFFIXES = (".whl", ".zip", ".egg", ".pyz")


@functools.cache
def _python_trees(roots: tuple[str, ...]) -> tuple[dict[str, list[str]], dict[str, set[str]]]:
    """One walk of `roots` (cached: a few seconds over a whole /usr): every folder holding
    Python files by its name, and every archive by the names of the package folders in it."""
    packages: dict[str, list[str]] = {}
    archives: dict[str, set[str]] = {}
    for root in roots:
        for directory, _, files in os.walk(root):
            if any(name.endswith(".py") for name in files):
                packages.setdefault(os.path.basename(directory), []).append(directory)
            for name in files:
                if name.endswith(ARCHIVE_SUFFIXES):
                    path = os.path.join(directory, name)
                    archives[path] = _archived_packages(path)
    return packages, archives


def _archived_packages(path: str) -> set[str]:
    """Names of the folders holding .py members of a zip archive (none if it is not one)."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.namelist()
    except (OSError, zipfile.BadZipFile, ValueError):
        return set()
    return {m.rsplit("/", 2)[-2] for m in members if m.endswith(".py") and "/" in m}


_site: str | None = None


def library_path() -> list[str]:
    """The one sys.path entry of the runner libraries: a folder of links to exactly those, so
    the factory's survey on the host and a grading in the sandbox import the same packages
    (nothing else of this environment's site-packages)."""
    global _site
    if _site is None or not os.path.isdir(_site):
        directory = isolation.process_temp_dir("cj_site_")
        for path in runner_libraries():
            os.symlink(path, os.path.join(directory, os.path.basename(path)))
        _site = directory
    return [_site]


_pycache: str | None = None


def pycache_dir() -> str:
    """A bytecode cache of pytest and the stdlib modules it imports, written once per process
    by the trusted interpreter (grading would otherwise compile pytest from source each time)."""
    global _pycache
    if _pycache is None or not os.path.isdir(_pycache):
        directory = isolation.process_temp_dir("cj_pycache_")
        warm = "import sys; sys.path[:0] = %r; import pytest, _pytest.python, unittest.mock" % (
            library_path(),
        )
        subprocess.run(
            [isolation.python_executable(), "-I", "-S", "-X", f"pycache_prefix={directory}"]
            + ["-c", warm],
            check=True,
            capture_output=True,
            timeout=120,
        )
        _pycache = directory
    return _pycache


def is_test_path(path: str) -> bool:
    """Whether a repository path is a test module or lives in a tests folder."""
    name = path.rsplit("/", 1)[-1]
    parts = path.split("/")
    return (
        name.startswith("test_")
        or name.endswith("_test.py")
        or "tests" in parts[:-1]
        or "test" in parts[:-1]
    )


def is_source_module(path: str, source_roots: tuple[str, ...] | list[str]) -> bool:
    """Whether a workspace file is one of the package's source modules the grading takes from
    the agent (a `.py` under a source root that is not a test, conftest or customize file)."""
    if not path.endswith(".py") or path.rsplit("/", 1)[-1] in PLANTED_NAMES:
        return False
    if not any(path.startswith(root.rstrip("/") + "/") for root in source_roots):
        return False
    return not is_test_path(path) and "__pycache__" not in path.split("/")


# Pristine files get this modification time, so the bytecode the trusted interpreter cached for
# them at a slot's first grading stays valid; the agent's modules keep their own times (their
# bytecode is never cached).
_PRISTINE_MTIME = 1_000_000_000
_slot_lock = threading.Lock()
_free_slots: list[int] = []
_slot_count = 0
_warmed: set[tuple[int, str]] = set()


@contextlib.contextmanager
def _slot():
    """A grading slot of this process: its tree's path is the same at every grading, so the
    tests' rewritten bytecode is compiled once per slot (one slot per concurrent grading)."""
    global _slot_count
    with _slot_lock:
        if not _free_slots:
            _free_slots.append(_slot_count)
            _slot_count += 1
        slot = _free_slots.pop()
    try:
        yield slot
    finally:
        with _slot_lock:
            _free_slots.append(slot)


def _build(root: Path, files: dict[str, bytes], source_roots) -> list[str]:
    """Writes the tree at `root`; returns the absolute paths of the agent's modules in it."""
    if root.exists():
        _remove(root)
    candidates = []
    for path, data in files.items():
        target = root / path
        _write(target, data)
        if is_source_module(path, source_roots):
            candidates.append(str(target))
        else:
            os.utime(target, (_PRISTINE_MTIME, _PRISTINE_MTIME))
    for directory, _, _ in os.walk(root):
        os.chmod(directory, 0o555)
    return candidates


def _remove(root: Path) -> None:
    for directory, _, _ in os.walk(root):
        os.chmod(directory, 0o755)
    shutil.rmtree(root, ignore_errors=True)


def _warm(root: Path, pristine: dict[str, str], grader: dict) -> None:
    """Collects the pristine tree once with the trusted interpreter writing bytecode, then drops
    what it cached for the source modules (only the tests' and conftests' bytecode is kept)."""
    _build(root, {p: t.encode("utf-8") for p, t in pristine.items()}, grader["source_roots"])
    settings = {
        "runner": _RUNNER_SOURCE,
        "mode": "collect",
        "root": str(root),
        "lib": library_path(),
        "paths": list(grader["test_paths"]),
        "ini": grader.get("ini"),
        "tmp": tempfile.gettempdir(),
    }
    subprocess.run(
        [isolation.python_executable(), "-I", "-S", "-X", f"pycache_prefix={pycache_dir()}"]
        + ["-c", harness.RUNNER_BOOT],
        input=json.dumps(settings) + "\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    for root_dir in grader["source_roots"]:
        shutil.rmtree(Path(pycache_dir() + str(root)) / root_dir, ignore_errors=True)


@contextlib.contextmanager
def grading_tree(pristine: dict[str, str], workspace: Path, grader: dict):
    """(host root of the assembled tree, absolute paths of the agent's modules in it)."""
    source_roots = grader["source_roots"]
    # Keyed by what the warmed bytecode depends on: every pristine file but the source modules
    # (which differ between a repository's tasks), so a repository warms once per slot.
    tests = sorted((p, t) for p, t in pristine.items() if not is_source_module(p, source_roots))
    key = hashlib.sha256(json.dumps(tests).encode()).hexdigest()[:16]
    with _slot() as slot:
        root = Path(_trees_dir()) / f"slot{slot}" / key
        if (slot, key) not in _warmed:
            _warm(root, pristine, grader)
            _warmed.add((slot, key))
        files = {
            path: text.encode("utf-8")
            for path, text in pristine.items()
            if not is_source_module(path, source_roots)
        }
        for directory, _, names in os.walk(workspace):
            for name in names:
                full = Path(directory) / name
                relative = str(full.relative_to(workspace))
                # Regular files only: a symlink could name a host file, and reading a named
                # pipe the agent left in the workspace would block the grader for good.
                if is_source_module(relative, source_roots) and _regular_file(full):
                    files[relative] = full.read_bytes()
        try:
            yield root, _build(root, files, source_roots)
        finally:
            _remove(root)


@contextlib.contextmanager
def replay_tree(root: Path, modules: dict[tuple[str, str | None], set[str]]):
    """(a copy of the grading tree at `root` without its tests, conftests and other planted
    files, an empty folder): what a replay runs on, with the empty folder over the workspace, so
    the code it replays can read neither the tests' expected values nor anything the test run
    left. Kept: the modules a recorded input names ((module, import root) -> the top-level names
    it refers to; import root None is the standard library) and the packages above them, a test
    module or package among them without its tests (`without_tests`)."""
    keep: dict[str, set[str]] = {}  # path -> the names its replay copy must define
    for (module, import_root), names in modules.items():
        if import_root is None:
            continue
        base = "" if import_root.strip("./") == "" else import_root.strip("/") + "/"
        parts = module.split(".")
        for depth in range(1, len(parts) + 1):
            stem = base + "/".join(parts[:depth])
            wanted = names if depth == len(parts) else set()
            for path in (stem + ".py", stem + "/__init__.py"):
                keep.setdefault(path, set()).update(wanted)
    files = {}
    for directory, _, names in os.walk(root):
        for name in names:
            relative = str((Path(directory) / name).relative_to(root))
            hidden = is_test_path(relative) or name in PLANTED_NAMES
            if relative in keep and hidden:
                source = (Path(directory) / name).read_bytes()
                files[relative] = without_tests(source, keep[relative])
            elif relative in keep or not (hidden or "__pycache__" in relative.split("/")):
                files[relative] = (Path(directory) / name).read_bytes()
    folder = Path(tempfile.mkdtemp(prefix="replay_", dir=_trees_dir()))
    try:
        (folder / "empty").mkdir(mode=0o555)
        _build(folder / "tree", files, ())
        yield folder / "tree", folder / "empty"
    finally:
        _remove(folder)


def without_tests(source: bytes, names: set[str]) -> bytes:
    """A test module without its tests: the functions and classes pytest collects and the
    module-level asserts go (at the top level and inside its if / try / with / for blocks)
    unless the module's other code or `names` (the helpers a recorded input refers to) need them,
    transitively. Everything else stays, so a helper keeps the module state it relies on; what
    goes is where the expected values are, which a replayed candidate could otherwise read."""
    tree = ast.parse(source)
    tests = {s.name: s for s in _module_statements(tree.body) if _is_test(s)}
    needed = set(names) | _loaded(s for s in _module_statements(tree.body) if not _is_test(s))
    kept: set[str] = set()
    while grown := (needed & set(tests)) - kept:
        kept |= grown
        needed |= _loaded(tests[name] for name in grown)
    _drop(tree.body, lambda s: isinstance(s, ast.Assert) or (_is_test(s) and s.name not in kept))
    return (ast.unparse(tree) + "\n").encode()


def _is_test(statement: ast.stmt) -> bool:
    """Whether pytest collects it: a `test*` function, a `Test*` class or a unittest case."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return statement.name.startswith("test")
    if isinstance(statement, ast.ClassDef):
        bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in statement.bases]
        return statement.name.startswith("Test") or any(b.endswith("TestCase") for b in bases)
    return False


def _blocks(statement: ast.stmt) -> list[list[ast.stmt]]:
    """The non-empty statement blocks of a compound statement that run at module level (an if,
    try, with, for, while or match), none of a definition's."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return []
    blocks = [getattr(statement, f, None) for f in ("body", "orelse", "finalbody")]
    blocks += [h.body for h in getattr(statement, "handlers", [])]
    blocks += [c.body for c in getattr(statement, "cases", [])]
    return [b for b in blocks if b]


def _module_statements(body: list[ast.stmt]):
    """The statements that run at module level: `body` and, recursively, its blocks."""
    for statement in body:
        yield statement
        for block in _blocks(statement):
            yield from _module_statements(block)


def _loaded(statements) -> set[str]:
    return {
        n.id
        for s in statements
        for n in ast.walk(s)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }


def _drop(body: list[ast.stmt], unwanted) -> None:
    """Removes the `unwanted` statements from `body` and its blocks in place (an emptied block
    gets a `pass`)."""
    body[:] = [s for s in body if not unwanted(s)] or [ast.Pass()]
    for statement in body:
        for block in _blocks(statement):
            _drop(block, unwanted)


def _regular_file(path: Path) -> bool:
    return stat.S_ISREG(path.lstat().st_mode)


_trees: str | None = None


def _trees_dir() -> str:
    global _trees
    if _trees is None or not os.path.isdir(_trees):
        _trees = isolation.process_temp_dir("cj_grade_")
    return _trees


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o444)


def harness_spec(grader: dict, graded_tests, root: Path, candidates: list[str]) -> dict:
    """The harness's input for one grading of the tree at `root` (see `harness.grade_pytest`)."""
    return {
        "kind": "pytest",
        "runner": _RUNNER_SOURCE,
        "root": str(root),
        "lib": library_path(),
        "paths": _test_files(grader, graded_tests),
        "ini": grader.get("ini"),
        "tmp": "/tmp",
        "pycache": pycache_dir(),
        "select": list(graded_tests),
        "candidate_files": candidates,
        "suite_seconds": grader.get("suite_seconds", 60.0),
    }


def _test_files(grader: dict, graded_tests) -> list[str]:
    """The files pytest collects: those of the graded tests (collecting the whole suite costs
    seconds per grading), or every test file when the grader asks (`collect_all`: the factory
    checks that a deletion leaves the whole suite importable)."""
    if grader.get("collect_all"):
        return list(grader["test_paths"])
    return sorted({test.split("::", 1)[0] for test in graded_tests})


def visible_test_command(test_files) -> str:
    """What the agent's `run_tests` runs in its workspace: pytest (bound read-only, see
    `test_binds`) on the given test files, stopping at the first failure."""
    setup = f"import sys; sys.path[:0] = ['.', *{library_path()!r}]; import pytest; "
    run = f"sys.exit(pytest.main(['-q', '-x', '--tb=short', '-p', 'no:cacheprovider', *{list(test_files)!r}]))"
    return "python3 -I -S -B -c " + shlex.quote(setup + run)


def test_binds() -> dict[str, str]:
    """pytest and its dependencies, read-only at their host paths, for `run_tests`."""
    return {path: path for path in (*library_path(), *runner_libraries())}


def read_only_binds(root: Path) -> dict[str, str]:
    """What the grading command sees beyond the sandbox's system view, each at its host path:
    the replay's binds and the bytecode cache."""
    return {**replay_binds(root), pycache_dir(): pycache_dir()}


def replay_binds(tree: Path) -> dict[str, str]:
    """What a replay sees beyond the sandbox's system view: its tree and the libraries, not the
    bytecode cache, which holds the tests' compiled modules with their expected values (the
    replay runs with -B and needs none of it)."""
    paths = [str(tree), *library_path(), *runner_libraries()]
    return {path: path for path in paths}
