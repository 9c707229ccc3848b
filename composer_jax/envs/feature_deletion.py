"""Feature-deletion task synthesis: the standard library, and third-party packages with their
own test suites.

For a module with tests: run the tests against a workspace copy of the original (inside the
sandbox, with any system copy and its bytecode masked), remove one covered function's body
(signature and docstring kept), run again, and keep the task when some originally passing tests
now fail: those are the graded tests.

- stdlib: module `m.py` with `test/test_m.py`; during the episode the original, its bytecode and
  the test file are masked.
- a package (`simplejson`, installed with the project): its pure-Python source is the workspace
  (compiled speedups left out), its own `tests` package is served to the grader from memory and
  never appears in the workspace.

The generated tasks (which hold the originals) are cached under the user cache directory, keyed
by the interpreter version, which is never mounted in the sandbox.
"""

import collections
import concurrent.futures
import dataclasses
import glob
import importlib.util
import json
import logging
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from composer_jax.envs.deletion import deletable_functions, delete_body
from composer_jax.envs.sandbox import Sandbox, SandboxLimits, python_executable
from composer_jax.envs.task import Task, run_grader

log = logging.getLogger(__name__)

MAX_FUNCTIONS_PER_MODULE = 3
CACHE_FORMAT = 2  # bump when Task's fields change
PACKAGES = ("simplejson",)  # pure Python with a fast unittest suite inside the package
_MAX_MODULE_BYTES = 80_000
_MAX_ORIGINAL_SECONDS = 8.0
_VALIDATION_LIMITS = SandboxLimits(
    cpu_seconds=30, wall_seconds=30, memory_bytes=2 << 30, output_bytes=4 << 20
)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    version = f"{sys.implementation.name}-{'.'.join(map(str, sys.version_info[:3]))}"
    return Path(base) / "composer_jax" / "feature_deletion" / version


def _startup_modules() -> set[str]:
    """Modules the interpreter imports before any script runs: those cannot be shadowed."""
    code = "import sys; print(' '.join(sys.modules))"
    out = subprocess.run([python_executable(), "-c", code], capture_output=True, text=True)
    return set(out.stdout.split())


def candidate_modules(stdlib: str | None = None) -> list[str]:
    """Single-file stdlib modules with a `test/test_<name>.py`, sorted."""
    stdlib = stdlib or sysconfig.get_paths()["stdlib"]
    startup = _startup_modules()
    names = []
    for test_file in sorted(glob.glob(os.path.join(stdlib, "test", "test_*.py"))):
        name = os.path.basename(test_file)[len("test_") : -len(".py")]
        module = os.path.join(stdlib, f"{name}.py")
        if name.startswith("_") or name in startup or not os.path.isfile(module):
            continue
        if os.path.getsize(module) <= _MAX_MODULE_BYTES:
            names.append(name)
    return names


def _bytecode_of(directory: str, stem: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "__pycache__", f"{stem}.*.pyc")))


def _deletable_functions(source: str, test_source: str) -> list[tuple[str, int, int, int]]:
    """Functions whose body spans two lines or more and whose name the tests mention."""
    return [
        function
        for function in deletable_functions(source, min_body_lines=2, dunders=())
        if function[0].rsplit(".", 1)[-1] in test_source
    ]


@dataclasses.dataclass(frozen=True)
class _Target:
    """One module to delete functions from: the workspace it lives in, its tests, its masks."""

    name: str  # task id prefix
    files: dict[str, str]  # the original workspace
    module_file: str  # the file functions are deleted from
    grader: dict
    test_source: str  # what the coverage heuristic searches for a function's name
    grading_hidden: tuple[str, ...] = ()
    episode_hidden: tuple[str, ...] = ()
    split: str = "train"


def _stdlib_target(name: str, stdlib: str) -> _Target:
    module_path = os.path.join(stdlib, f"{name}.py")
    test_path = os.path.join(stdlib, "test", f"test_{name}.py")
    grading_hidden = (module_path, *_bytecode_of(stdlib, name))
    return _Target(
        name=f"stdlib-{name}",
        files={f"{name}.py": Path(module_path).read_text(encoding="utf-8")},
        module_file=f"{name}.py",
        grader={"kind": "unittest", "modules": [f"test.test_{name}"]},
        test_source=Path(test_path).read_text(encoding="utf-8"),
        grading_hidden=grading_hidden,
        episode_hidden=(
            *grading_hidden,
            test_path,
            *_bytecode_of(os.path.join(stdlib, "test"), f"test_{name}"),
        ),
        split=_split_of(name),
    )


def package_targets(package: str) -> list[_Target]:
    """One target per module of an installed package with a `tests` subpackage."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} is not installed (it comes with the project)")
    root = Path(next(iter(spec.submodule_search_locations)))
    files, sources = {}, {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root.parent)
        dotted = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        if relative.parts[1] == "tests":
            sources[dotted] = path.read_text(encoding="utf-8")
        else:
            files[str(relative)] = path.read_text(encoding="utf-8")
    tests = sorted(n for n in sources if n.rsplit(".", 1)[-1].startswith("test_"))
    grader = {
        "kind": "unittest",
        "modules": tests,
        "sources": sources,
        "packages": [f"{package}.tests"],
    }
    test_source = "\n".join(sources[n] for n in tests)
    return [
        _Target(
            name=f"{package}-{Path(module).stem}",
            files=files,
            module_file=module,
            grader=grader,
            test_source=test_source,
            split=_split_of(f"{package}.{Path(module).stem}"),
        )
        for module in sorted(files)
        if len(files[module]) <= _MAX_MODULE_BYTES
    ]


def _target_tasks(target: _Target, rng: random.Random, backend: str) -> list[Task]:
    started = time.monotonic()
    # Validation runs the task's own code (the original module and its tests), not a model's.
    with Sandbox.from_files(target.files, backend=backend, require_isolation=False) as sandbox:
        outcomes, _, _ = run_grader(
            sandbox, target.grader, _VALIDATION_LIMITS, target.grading_hidden
        )
    passing = {t for t, outcome in outcomes.items() if outcome == "pass"}
    if not passing or time.monotonic() - started > _MAX_ORIGINAL_SECONDS:
        return []
    original = target.files[target.module_file]
    try:
        functions = _deletable_functions(original, target.test_source)
    except SyntaxError:
        return []
    rng.shuffle(functions)
    tasks = []
    for qualname, first, last, indent in functions:
        if len(tasks) >= MAX_FUNCTIONS_PER_MODULE:
            break
        deleted = {**target.files, target.module_file: delete_body(original, first, last, indent)}
        with Sandbox.from_files(deleted, backend=backend, require_isolation=False) as sandbox:
            after, _, _ = run_grader(
                sandbox, target.grader, _VALIDATION_LIMITS, target.grading_hidden
            )
        broken = tuple(sorted(t for t in passing if after.get(t) != "pass"))
        if not broken:
            continue
        prompt = (
            f"The body of `{qualname}` in {target.module_file} was removed (signature and "
            f"docstring kept). Implement it so the code works again.\n"
        )
        tasks.append(
            Task(
                task_id=f"{target.name}-{qualname}",
                prompt=prompt,
                files=deleted,
                grader=target.grader,
                graded_tests=broken,
                hidden_paths=target.episode_hidden,
                grading_hidden_paths=target.grading_hidden,
                oracle_files={target.module_file: original},
                split=target.split,
                family="feature_deletion",
            )
        )
    return tasks


def _split_of(module: str) -> str:
    """About a fifth of the modules are held out (by module, so the splits share no code)."""
    return "held_out" if sum(module.encode()) % 5 == 0 else "train"


def synthesize_stdlib_tasks(
    count: int,
    *,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    time_budget_s: float = 300.0,
    workers: int = 2,
    backend: str = "auto",
) -> list[Task]:
    """At least `count` verified stdlib tasks when the stdlib has them (fewer if the budget runs
    out). Cached per (interpreter version, seed): a later call for at most as many tasks reads
    them back instantly."""
    stdlib = sysconfig.get_paths()["stdlib"]

    def targets():
        modules = candidate_modules(stdlib)
        random.Random(seed).shuffle(modules)
        return (_stdlib_target(name, stdlib) for name in modules)

    return _synthesize(targets, "stdlib", count, seed, cache_dir, time_budget_s, workers, backend)


def synthesize_package_tasks(
    package: str,
    count: int,
    *,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    time_budget_s: float = 300.0,
    workers: int = 2,
    backend: str = "auto",
) -> list[Task]:
    """Verified feature-deletion tasks over an installed third-party package (see PACKAGES),
    graded by the package's own tests; cached like the stdlib ones."""

    def targets():
        found = package_targets(package)
        random.Random(seed).shuffle(found)
        return iter(found)

    return _synthesize(targets, package, count, seed, cache_dir, time_budget_s, workers, backend)


def _synthesize(targets, kind, count, seed, cache_dir, time_budget_s, workers, backend):
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_file = cache / f"{kind}-v{CACHE_FORMAT}-seed{seed}.json"
    cached = _read_cache(cache_file)
    if cached is not None and len(cached) >= count:
        return cached[:count]
    started = time.monotonic()
    tasks: list[Task] = []
    # Results are taken in target order, not completion order, so which tasks a seed yields does
    # not depend on which worker finishes first.
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        window: collections.deque = collections.deque()
        queue = targets()
        while len(tasks) < count:
            for target in queue:
                rng = random.Random(f"{seed}-{target.name}")
                window.append((pool.submit(_target_tasks, target, rng, backend), target.name))
                if len(window) >= workers:
                    break
            if not window:
                break
            future, name = window.popleft()
            try:
                tasks.extend(future.result())
            except (OSError, SyntaxError, UnicodeError) as error:
                log.warning("skipping %s: %s", name, error)
            if time.monotonic() - started > time_budget_s:
                log.warning("feature deletion: time budget spent with %d tasks", len(tasks))
                break
        for future, _ in window:
            future.cancel()
    tasks.sort(key=lambda t: t.task_id)
    log.info("feature deletion: %d tasks in %.0fs", len(tasks), time.monotonic() - started)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.NamedTemporaryFile("w", dir=cache, delete=False, suffix=".tmp")
    with tmp:
        json.dump([t.to_json() for t in tasks], tmp)
    os.replace(tmp.name, cache_file)
    return tasks[:count]


def _read_cache(path: Path) -> list[Task] | None:
    """The cached tasks, or None when there are none or the file is unreadable (regenerated)."""
    if not path.exists():
        return None
    try:
        return [Task.from_json(t) for t in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError, KeyError) as error:
        log.warning("ignoring the unreadable task cache %s (%s)", path, error)
        return None
