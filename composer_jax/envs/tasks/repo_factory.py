"""Repository tasks from a real package: delete a function the package's own tests cover, keep
the task when those tests then fail and pass again with the original.

Steps (`build_tasks`): fetch the package's source distribution from the registry (or take a
local folder), find its source modules, tests and pytest settings (`find_layout`), run the whole
suite once on the original through the runner's `survey` mode, in a sandbox like an episode's
commands (no network, writes only to its tree), which also records which source functions each
test calls, then for each covered function (signature and docstring kept, body
replaced by `raise NotImplementedError`) grade the deletion and the original through the real
grading path, then record the graded tests' calls to the function for replay grading
(`attach_replay`, see `replay`) and check it the same way. Every candidate dropped is counted
under its reason.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import random
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from composer_jax.envs.grading import harness, replay, repo_grading
from composer_jax.envs.grading.task import GradeResult, Task, grade_solution, replay_solution
from composer_jax.envs.sandbox import isolation
from composer_jax.envs.sandbox.box import Sandbox, SandboxLimits
from composer_jax.envs.tasks import test_literals
from composer_jax.envs.tasks._deletion import deletable_functions, delete_body

_INI_FILES = (
    ("pytest.ini", "[pytest]"),
    ("pyproject.toml", "[tool.pytest.ini_options]"),
    ("tox.ini", "[pytest]"),
    ("setup.cfg", "[tool:pytest]"),
)
_SKIPPED_DIRS = {"docs", "doc", "examples", "benchmarks", "bench", ".git", "build", "dist"}
_MAX_FILE_BYTES = 400_000
MAX_GRADED_TESTS = 8


class FactoryError(ValueError):
    """A package that cannot be turned into tasks at all (no source, no tests, no suite)."""


@dataclasses.dataclass(frozen=True)
class Repository:
    """A package's source and tests as text, with what grading needs to run them."""

    name: str
    version: str
    source: str
    source_roots: tuple[str, ...]
    test_paths: tuple[str, ...]
    ini: str | None
    files: dict[str, str]

    @functools.cached_property
    def source_constants(self) -> frozenset[str]:
        """The distinctive constants of the package's source (`test_literals`), once per set."""
        return test_literals.package_constants(self.files, self.source_roots)

    def grader(self) -> dict:
        return {
            "kind": "pytest",
            "source_roots": list(self.source_roots),
            "test_paths": list(self.test_paths),
            "ini": self.ini,
        }

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Repository:
        data = dict(data)
        data["source_roots"] = tuple(data["source_roots"])
        data["test_paths"] = tuple(data["test_paths"])
        return cls(**data)


def fetch_source(requirement: str, cache: Path) -> Path:
    """The unpacked source distribution of `requirement` (e.g. "toolz==1.0.0"), downloaded with
    pip into `cache` (the registry the machine is configured for)."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as download:
        command = [
            *[sys.executable, "-m", "pip", "download", "--no-deps"],
            *["--no-binary", ":all:", "--quiet", "-d", download, requirement],
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        archives = sorted(Path(download).iterdir())
        if result.returncode != 0 or not archives:
            why = (result.stderr.strip().splitlines() or ["no archive"])[-1]
            raise FactoryError(
                f"pip found no source distribution of {requirement} (a wheel-only package has "
                f"none): {why}"
            )
        archive = archives[0]
        target = cache / archive.name.removesuffix(".tar.gz").removesuffix(".zip")
        if not target.exists():
            unpack_archive(archive, target)
    return target


def unpack_archive(archive: Path, target: Path) -> None:
    """The archive's tree at `target` (a member that would land outside it is refused by the
    "data" filter); a corrupt archive is a FactoryError."""
    staging = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        try:
            if archive.name.endswith(".zip"):
                with zipfile.ZipFile(archive) as z:
                    z.extractall(staging)
            else:
                with tarfile.open(archive) as t:
                    t.extractall(staging, filter="data")
        except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as error:
            why = " ".join(str(error).split())[:200]
            raise FactoryError(f"{archive.name}: not a readable archive ({why})") from None
        tops = list(staging.iterdir())
        (tops[0] if len(tops) == 1 and tops[0].is_dir() else staging).rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def find_layout(tree: Path, name: str, version: str, source: str) -> Repository:
    """The repository's files: source packages (a `src/` layout is flattened), test files and
    conftests, the pytest settings file and the license."""
    base = tree / "src" if (tree / "src").is_dir() else tree
    roots = sorted(
        p.name
        for p in base.iterdir()
        if p.is_dir()
        and (p / "__init__.py").exists()
        and p.name not in _SKIPPED_DIRS
        and p.name not in ("tests", "test", "testing")
    )
    if not roots:
        raise FactoryError(f"{tree}: no Python package (a folder with __init__.py) found")
    files: dict[str, str] = {}
    for root in roots:
        for path in sorted((base / root).rglob("*.py")):
            _keep(files, path, str(path.relative_to(base)))
    for path in sorted(tree.rglob("*.py")):
        relative = str(path.relative_to(tree))
        parts = relative.split("/")
        if set(parts[:-1]) & _SKIPPED_DIRS or relative.startswith("src/"):
            continue
        if repo_grading.is_test_path(relative) or parts[-1] == "conftest.py":
            _keep(files, path, relative)
    ini = None
    for candidate, section in _INI_FILES:
        path = tree / candidate
        if path.is_file() and section in path.read_text(encoding="utf-8", errors="replace"):
            ini = candidate
            _keep(files, path, candidate)
            break
    for path in sorted(tree.glob("LICEN[CS]E*")):
        _keep(files, path, path.name)
    tests = tuple(
        sorted(
            p
            for p in files
            if repo_grading.is_test_path(p) and p.rsplit("/", 1)[-1].startswith("test")
        )
    )
    if not tests:
        raise FactoryError(f"{tree}: no test files (test_*.py) found")
    return Repository(name, version, source, tuple(roots), tests, ini, files)


def _keep(files: dict[str, str], path: Path, relative: str) -> None:
    if path.stat().st_size <= _MAX_FILE_BYTES:
        try:
            files[relative] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            pass


# A survey runs a whole suite: a test suite's room, and its verdict (every test's outcome and
# coverage) can run to megabytes.
def _survey_limits(seconds: float) -> SandboxLimits:
    return SandboxLimits(
        cpu_seconds=int(seconds),
        wall_seconds=seconds,
        memory_bytes=4 << 30,
        output_bytes=256 << 20,
        max_processes=256,
        workspace_bytes=1 << 30,
        workspace_files=100_000,
        tmp_bytes=256 << 20,
    )


def _run_runner(files: dict[str, str], settings: dict, name: str, seconds: float, backend: str):
    """(the verdict, the tree's root as the runner saw it) of the runner on `files`, in a
    sandbox as an episode's commands run (no network, writes only to its tree and /tmp);
    `settings` says the mode (see `_repo_runner`). The backend "rlimit" runs it unisolated, as
    the caller asked."""
    limits = _survey_limits(seconds)
    options = dict(limits=limits, backend=backend, require_isolation=backend != "rlimit")
    with Sandbox.from_files(files, **options) as sandbox:
        root = Path(isolation.WORKSPACE_MOUNT if sandbox.isolated else sandbox.workspace)
        settings = {
            "runner": repo_grading.runner_source(),
            "root": str(root),
            "lib": repo_grading.library_path(),
            "tmp": "/tmp" if sandbox.isolated else str(sandbox.workspace.parent),
            **{k: v(root) if callable(v) else v for k, v in settings.items()},
        }
        result = sandbox.run(
            "exec python3 -I -S -B -c " + shlex.quote(harness.RUNNER_BOOT),
            stdin=json.dumps(settings) + "\n",
            extra_ro_binds=repo_grading.test_binds() if sandbox.isolated else None,
        )
    if result.killed_reason in ("wall", "cpu"):
        raise FactoryError(f"{name}: the suite ran past {seconds:.0f}s")
    verdict = _last_verdict(result.output)
    if verdict is None:
        tail = " ".join(result.output[-300:].split())
        raise FactoryError(f"{name}: the suite did not run (exit {result.returncode}): {tail}")
    return verdict, root


def _last_verdict(output: str) -> dict | None:
    """The runner's verdict: its last line (the suite's own output comes before it)."""
    lines = output.strip().splitlines()
    try:
        verdict = json.loads(lines[-1])
    except (ValueError, IndexError):
        return None
    return verdict if isinstance(verdict, dict) and "tests" in verdict else None


def survey(
    repo: Repository, seconds: float = 600.0, backend: str = "auto"
) -> tuple[dict[str, str], dict, list]:
    """(outcome of every test on the original, {test: [(module path, qualname), ...]}, the
    collectors that failed to collect), the suite run in a sandbox."""
    sources = [p for p in repo.files if repo_grading.is_source_module(p, repo.source_roots)]
    settings = {
        "mode": "survey",
        "paths": list(repo.test_paths),
        "ini": repo.ini,
        "select": None,
        "trace_files": lambda root: [str(root / p) for p in sources],
    }
    verdict, root = _run_runner(repo.files, settings, repo.name, seconds, backend)
    prefix = str(root) + "/"
    coverage = {
        test: [tuple(c.removeprefix(prefix).split(":", 1)) for c in calls]
        for test, calls in verdict.get("coverage", {}).items()
    }
    return verdict["tests"], coverage, verdict["errors"]


MAX_CALLS_PER_TEST = 16
MAX_CALL_BYTES = 16_384


def record_calls(
    task: Task, seconds: float = 300.0, backend: str = "auto"
) -> tuple[dict[str, list], dict[str, int]]:
    """({graded test: [encoded (args, kwargs) of each call it makes to the task's function]},
    {graded test: calls whose arguments are not plain data}), on the original code, in a
    sandbox."""
    path, qualname = task.metadata["path"], task.metadata["deletion"][0]
    settings = {
        "mode": "record",
        "paths": sorted({t.split("::", 1)[0] for t in task.graded_tests}),
        "ini": task.grader.get("ini"),
        "select": list(task.graded_tests),
        "codec": harness.CODEC_SOURCE,
        "target": lambda root: [str(root / path), qualname],
        "max_calls": MAX_CALLS_PER_TEST,
        "max_bytes": MAX_CALL_BYTES,
    }
    files = {**task.files, **task.oracle_files}
    verdict, _ = _run_runner(files, settings, task.task_id, seconds, backend)
    calls = {t: verdict.get("calls", {}).get(t, []) for t in task.graded_tests}
    opaque = {t: int(verdict.get("opaque_calls", {}).get(t, 0)) for t in task.graded_tests}
    return calls, opaque


MAX_REPLAYED_CALLS = 64


def attach_replay(task: Task, backend: str) -> tuple[Task, str]:
    """The task with its replay (the graded tests' calls to the function and the original's
    outcomes, see `replay`), narrowed to the graded tests that make a replayable call, and
    "kept"; or the task unchanged and why nothing can be replayed (arguments or results that
    are not plain data, outcomes that differ between two runs of the original)."""
    recorded, opaque = record_calls(task, backend=backend)
    calls = {
        "module": replay.module_name(task.metadata["path"]),
        "qualname": task.metadata["deletion"][0],
        "calls": [{"test": t, "input": c} for t in task.graded_tests for c in recorded[t]],
    }
    if not calls["calls"]:
        return task, "no call with plain-data arguments"
    options = {"backend": backend, "require_isolation": False}
    first = replay_solution(task, task.oracle_files, calls, **options)
    second = replay_solution(task, task.oracle_files, calls, **options)
    if first is None or second is None:
        return task, "the original does not replay"
    per_test = collections.defaultdict(list)
    for index, call in enumerate(calls["calls"]):
        if replay.replayable(call, first[index]) and replay.same(second[index], first[index]):
            per_test[call["test"]].append(index)
    if not per_test:
        return task, "no replayable call"
    budget = max(1, MAX_REPLAYED_CALLS // len(per_test))
    kept = sorted(i for indices in per_test.values() for i in indices[:budget])
    calls["calls"] = [calls["calls"][i] for i in kept]
    calls["expected"] = [first[i] for i in kept]
    counts = {
        "recorded": sum(map(len, recorded.values())),
        "not_plain_data": sum(opaque.values()),
        "replayed": len(kept),
        "tests_without_replay": len(task.graded_tests) - len(per_test),
    }
    narrowed = dataclasses.replace(
        task,
        grader={**task.grader, "replay": calls},
        graded_tests=tuple(t for t in task.graded_tests if t in per_test),
        metadata={**task.metadata, "replay": counts},
    )
    return narrowed, "kept"


def make_task(
    repo: Repository,
    path: str,
    deletion: tuple,
    tests,
    split: str,
    *,
    replay: dict | None = None,
    replay_counts: dict | None = None,
) -> Task:
    """The task of deleting one function (`deletion` as `deletable_functions` gives it), with
    its replay when one was recorded (`attach_replay`)."""
    qualname, first, last, indent = deletion
    original = repo.files[path]
    grader = repo.grader() if replay is None else {**repo.grader(), "replay": replay}
    metadata = {"repository": repo.name, "path": path, "deletion": list(deletion)}
    if replay is not None:
        metadata["replay"] = dict(replay_counts or {})
    return Task(
        task_id=f"{repo.name}/{path}:{qualname}",
        prompt=(
            f"In this repository ({repo.name} {repo.version}), the body of `{qualname}` in "
            f"{path} was removed (signature and docstring kept). Implement it so the "
            f"package's tests pass again.\n"
        ),
        files={**repo.files, path: delete_body(original, first, last, indent)},
        grader=grader,
        graded_tests=tuple(tests),
        test_literals=test_literals.graded_test_literals(repo.files, tests, repo.source_constants),
        visible_test_command=repo_grading.visible_test_command(
            sorted({test.split("::", 1)[0] for test in tests})
        ),
        protected_paths=tuple(
            p for p in repo.files if not repo_grading.is_source_module(p, repo.source_roots)
        ),
        oracle_files={path: original},
        split=split,
        family="repository",
        metadata=metadata,
        group=f"repository={repo.name}",
    )


@dataclasses.dataclass
class BuildReport:
    """How many candidates were kept, and why the others were dropped."""

    candidates: int = 0
    kept: int = 0
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def summary(self) -> str:
        reasons = ", ".join(f"{n} {why}" for why, n in self.dropped.most_common())
        return f"{self.kept} of {self.candidates} candidates kept" + (
            f"; dropped: {reasons}" if reasons else ""
        )


def _candidates(repo: Repository, outcomes, coverage, rng) -> list[tuple[str, tuple, list]]:
    """(module path, deletion, covering passing tests) for each covered deletable function."""
    covering = collections.defaultdict(set)
    for test, calls in coverage.items():
        if outcomes.get(test) == "pass":
            for path, qualname in calls:
                covering[(path, qualname)].add(test)
    found = []
    for path in sorted(repo.files):
        if not repo_grading.is_source_module(path, repo.source_roots):
            continue
        try:
            functions = deletable_functions(repo.files[path])
        except SyntaxError:
            continue
        for deletion in functions:
            tests = sorted(covering.get((path, deletion[0]), ()))
            found.append((path, deletion, rng.sample(tests, min(len(tests), MAX_GRADED_TESTS))))
    rng.shuffle(found)
    return found


def _whole_suite(task: Task) -> Task:
    return dataclasses.replace(task, grader={**task.grader, "collect_all": True})


def verify(task: Task, backend: str, baseline_errors: float = 0) -> tuple[Task | None, str]:
    """The task narrowed to the tests its deletion breaks, or None and why it is dropped
    (`baseline_errors`: the collection errors of the whole suite on the original)."""
    options = {"backend": backend, "require_isolation": False}
    deleted: GradeResult = grade_solution(_whole_suite(task), {}, **options)
    if deleted.scores.get("runner_void") or deleted.scores.get("tampered"):
        return None, "the runner gave no verdict on the deletion"
    if deleted.scores.get("collection_errors", 0) > baseline_errors:
        return None, "the deletion breaks the collection of the tests"
    broken = tuple(t for t in task.graded_tests if deleted.outcomes.get(t) != "pass")
    if not broken:
        return None, "tests pass with the deletion"
    narrowed = dataclasses.replace(task, graded_tests=broken)
    original = grade_solution(narrowed, narrowed.oracle_files, **options)
    if original.reward != 1.0:
        return None, "the original fails its tests when run alone"
    return narrowed, "kept"


def build_tasks(
    repo: Repository,
    *,
    max_tasks: int = 100,
    seed: int = 0,
    held_out: Callable[[str], bool] = lambda task_id: False,
    backend: str = "auto",
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Repository, list[Task], BuildReport]:
    """Verified tasks of `repo` (at most `max_tasks`), deterministic by seed, and the
    repository as the tasks use it (test files that do not collect on the original left out)."""
    outcomes, coverage, errors = survey(repo, backend=backend)
    if not any(o == "pass" for o in outcomes.values()):
        raise FactoryError(f"{repo.name}: no test passes on the original code")
    repo = dataclasses.replace(
        repo, test_paths=tuple(p for p in repo.test_paths if p not in errors)
    )
    report, tasks, baseline = BuildReport(), [], None
    candidates = _candidates(repo, outcomes, coverage, random.Random(seed))
    for index, (path, deletion, tests) in enumerate(candidates):
        if len(tasks) >= max_tasks:
            break
        report.candidates += 1
        if progress is not None:
            progress(index + 1, len(candidates))
        if not tests:
            report.dropped["no passing test calls it"] += 1
            continue
        task_id = f"{repo.name}/{path}:{deletion[0]}"
        task = make_task(repo, path, deletion, tests, "held_out" if held_out(task_id) else "train")
        if baseline is None:  # what the guarded runner fails to collect on the original
            original = grade_solution(
                _whole_suite(task), task.oracle_files, backend=backend, require_isolation=False
            )
            baseline = original.scores.get("collection_errors", 0)
        task, why = verify(task, backend, baseline)
        if task is not None:
            task, why = with_verified_replay(task, backend)
        if task is None:
            report.dropped[why] += 1
            continue
        tasks.append(task)
        report.kept += 1
    return repo, sorted(tasks, key=lambda t: t.task_id), report


def with_verified_replay(task: Task, backend: str) -> tuple[Task | None, str]:
    """The task with its replay once the replay grading gives the original 1.0 and the deletion
    0, or None and why it is dropped (a task without a replay is never shipped: its reward
    would rest on a verdict written inside the candidate's process)."""
    task, why = attach_replay(task, backend)
    if why != "kept":
        return None, why
    if not replay.value_tests(task.grader["replay"]):
        return None, "no graded test checks a value (a body that only raises passes them)"
    options = {"backend": backend, "require_isolation": False}
    if grade_solution(task, task.oracle_files, **options).reward != 1.0:
        return None, "the original fails its replay"
    if grade_solution(task, {}, **options).reward != 0.0:
        return None, "the deletion passes its replay"
    return task, "kept"


def add_replay(
    tasks: list[Task],
    backend: str = "auto",
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[Task], BuildReport]:
    """Replay recorded for tasks that were verified without one (a task set written before
    replay grading), keeping their ids and splits; the others dropped with their reason."""
    report, kept = BuildReport(), []
    for index, task in enumerate(tasks):
        report.candidates += 1
        task, why = with_verified_replay(task, backend)
        if task is None:
            report.dropped[why] += 1
        else:
            kept.append(task)
            report.kept += 1
        if progress is not None:
            progress(index + 1, len(tasks))
    return kept, report
