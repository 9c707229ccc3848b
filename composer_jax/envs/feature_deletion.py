"""Feature-deletion task synthesis from the standard library and its `test` package.

For a module `m.py` with `test/test_m.py`: run the tests against a workspace copy of the original
(inside the sandbox, with the system copy and its bytecode masked), remove one covered function's
body (signature and docstring kept), run again, and keep the task when some originally passing
tests now fail: those are the graded tests. During the episode the original module, its bytecode
and the test file are masked; the generated tasks (which hold the originals) are cached under the
user cache directory, keyed by the interpreter version, which is never mounted in the sandbox.
"""

import ast
import concurrent.futures
import glob
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

from composer_jax.envs.sandbox import Sandbox, SandboxLimits, python_executable
from composer_jax.envs.task import RESULT_PREFIX, Task, grade

log = logging.getLogger(__name__)

MAX_FUNCTIONS_PER_MODULE = 3
_MAX_MODULE_BYTES = 80_000
_MAX_ORIGINAL_SECONDS = 8.0
_VALIDATION_LIMITS = SandboxLimits(
    cpu_seconds=30, wall_seconds=30, memory_bytes=2 << 30, output_bytes=4 << 20
)

_RUNNER = """import os, sys
sys.path.insert(0, os.getcwd())  # the workspace module shadows the (masked) stdlib one
import json, unittest

class Recorder(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.outcomes = {}
    def addSuccess(self, test):
        self.outcomes.setdefault(test.id(), 'pass')  # a failed subtest already said 'fail'
    def addFailure(self, test, err):
        self.outcomes[test.id()] = 'fail'
    def addError(self, test, err):
        self.outcomes[getattr(test, 'id', lambda: str(test))()] = 'error'
    def addSkip(self, test, reason):
        self.outcomes[test.id()] = 'skip'
    def addExpectedFailure(self, test, err):
        self.outcomes[test.id()] = 'pass'
    def addUnexpectedSuccess(self, test):
        self.outcomes[test.id()] = 'fail'
    def addSubTest(self, test, subtest, err):
        if err is not None:
            self.outcomes[test.id()] = 'fail'

result = Recorder()
unittest.defaultTestLoader.loadTestsFromName(sys.argv[1]).run(result)
sys.stdout.flush()
print()
print(PREFIX + json.dumps({'tests': result.outcomes}), flush=True)
"""


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
    """(qualified name, first body line, last line, indent) of functions whose body can go."""
    tree = ast.parse(source)
    found = []
    for node in tree.body:
        members = [(node, "")]
        if isinstance(node, ast.ClassDef):
            members = [(item, f"{node.name}.") for item in node.body]
        for item, owner in members:
            if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if item.name.startswith("__") or item.name not in test_source:
                continue
            body = item.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            if not body or item.end_lineno - body[0].lineno < 1:
                continue
            if any(n.lineno == body[0].lineno for n in body[1:]):
                continue
            if body[0].col_offset <= item.col_offset:
                continue  # one-line def: the body shares the signature's line
            found.append((owner + item.name, body[0].lineno, item.end_lineno, body[0].col_offset))
    return found


def delete_body(source: str, first: int, last: int, indent: int) -> str:
    lines = source.splitlines(keepends=True)
    stub = " " * indent + "raise NotImplementedError\n"
    return "".join(lines[: first - 1]) + stub + "".join(lines[last:])


def _module_tasks(name: str, stdlib: str, rng: random.Random, backend: str) -> list[Task]:
    module_path = os.path.join(stdlib, f"{name}.py")
    test_path = os.path.join(stdlib, "test", f"test_{name}.py")
    original = Path(module_path).read_text(encoding="utf-8")
    test_source = Path(test_path).read_text(encoding="utf-8")
    grading_hidden = (module_path, *_bytecode_of(stdlib, name))
    episode_hidden = (
        *grading_hidden,
        test_path,
        *_bytecode_of(os.path.join(stdlib, "test"), f"test_{name}"),
    )
    base = Task(
        task_id="",
        prompt="",
        files={f"{name}.py": original},
        hidden_files={"cj_runner.py": _RUNNER.replace("PREFIX", repr(RESULT_PREFIX))},
        test_command=f"python3 {{hidden}}/cj_runner.py test.test_{name}",
        hidden_paths=episode_hidden,
        grading_hidden_paths=grading_hidden,
        family="feature_deletion",
    )
    started = time.monotonic()
    # Validation runs the task's own code (the original module and its tests), not a model's.
    with Sandbox.from_files(base.files, backend=backend, require_isolation=False) as sandbox:
        baseline = grade(sandbox, base, _VALIDATION_LIMITS)
    passing = {t for t, outcome in baseline.outcomes.items() if outcome == "pass"}
    if not passing or time.monotonic() - started > _MAX_ORIGINAL_SECONDS:
        return []
    try:
        functions = _deletable_functions(original, test_source)
    except SyntaxError:
        return []
    rng.shuffle(functions)
    tasks = []
    for qualname, first, last, indent in functions:
        if len(tasks) >= MAX_FUNCTIONS_PER_MODULE:
            break
        deleted = delete_body(original, first, last, indent)
        candidate = _with(base, files={f"{name}.py": deleted}, graded_tests=tuple(sorted(passing)))
        with Sandbox.from_files(
            candidate.files, backend=backend, require_isolation=False
        ) as sandbox:
            result = grade(sandbox, candidate, _VALIDATION_LIMITS)
        broken = tuple(sorted(t for t in passing if result.outcomes.get(t) != "pass"))
        if not broken:
            continue
        prompt = (
            f"The body of `{qualname}` in {name}.py was removed (signature and docstring kept). "
            f"Implement it so the module works again.\n"
        )
        tasks.append(
            _with(
                candidate,
                task_id=f"stdlib-{name}-{qualname}",
                prompt=prompt,
                graded_tests=broken,
                oracle_files={f"{name}.py": original},
                split=_split_of(name),
            )
        )
    return tasks


def _split_of(module: str) -> str:
    """About a fifth of the modules are held out (by module, so the splits share no code)."""
    return "held_out" if sum(module.encode()) % 5 == 0 else "train"


def _with(task: Task, **changes) -> Task:
    data = task.to_json()
    data.update(changes)
    return Task.from_json(data)


def synthesize_stdlib_tasks(
    count: int,
    *,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    time_budget_s: float = 300.0,
    workers: int = 2,
    backend: str = "auto",
) -> list[Task]:
    """At least `count` verified tasks when the stdlib has them (fewer if the budget runs out).

    Results are cached per (interpreter version, seed): a later call for at most as many tasks
    reads them back instantly.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_file = cache / f"seed{seed}.json"
    if cache_file.exists():
        cached = [Task.from_json(t) for t in json.loads(cache_file.read_text())]
        if len(cached) >= count:
            return cached[:count]
    stdlib = sysconfig.get_paths()["stdlib"]
    modules = candidate_modules(stdlib)
    random.Random(seed).shuffle(modules)
    started = time.monotonic()
    tasks: list[Task] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        pending = {}
        queue = list(modules)
        while (queue or pending) and len(tasks) < count:
            while queue and len(pending) < workers:
                name = queue.pop(0)
                rng = random.Random(f"{seed}-{name}")
                pending[pool.submit(_module_tasks, name, stdlib, rng, backend)] = name
            done, _ = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
            for future in done:
                name = pending.pop(future)
                try:
                    tasks.extend(future.result())
                except (OSError, SyntaxError, UnicodeError) as error:
                    log.warning("skipping %s: %s", name, error)
            if time.monotonic() - started > time_budget_s:
                log.warning("feature deletion: time budget spent with %d tasks", len(tasks))
                break
        for future in pending:
            future.cancel()
    tasks.sort(key=lambda t: t.task_id)
    log.info("feature deletion: %d tasks in %.0fs", len(tasks), time.monotonic() - started)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.NamedTemporaryFile("w", dir=cache, delete=False, suffix=".tmp")
    with tmp:
        json.dump([t.to_json() for t in tasks], tmp)
    os.replace(tmp.name, cache_file)
    return tasks[:count]
