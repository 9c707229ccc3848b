"""Per-episode workspaces and isolated command execution.

A command runs under one of the backends of `isolation` (bubblewrap, util-linux unshare, or the
unisolated rlimit fallback), inside a cgroup that caps the processes and memory of the whole
command and is killed as a unit at the end (`cgroups`), with per-process rlimits on CPU time,
address space and file size, a wall-clock limit, an output cap, and a cap on the workspace's total
size and file count that holds across the episode. Nothing a command starts outlives it: the
namespaced backends give it its own PID namespace (its first process's exit ends every other),
and the launcher dies with the worker that started it.

Where isolation is required (the default; RL and evaluation run model-written code) and no
isolating backend works, creating a sandbox fails with a message saying how to get one.
"""

import dataclasses
import logging
import os
import selectors
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from composer_jax.envs.sandbox import cgroups, isolation
from composer_jax.envs.sandbox.isolation import (
    WORKSPACE_MOUNT,
    IsolationUnavailable,
    python_executable,
)

log = logging.getLogger(__name__)

__all__ = [
    "WORKSPACE_MOUNT",
    "CommandResult",
    "IsolationUnavailable",
    "Sandbox",
    "SandboxLimits",
    "WorkspaceLimitError",
    "bwrap_available",
    "python_executable",
    "read_files",
    "write_files",
]

_warned: set[str] = set()
_lock = threading.Lock()
_WATCH_SECONDS = 0.1  # how often a running command's workspace size is checked


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits. `memory_bytes` and `max_processes` bound a whole command (all its
    processes) where a cgroup can be made, else each process; `workspace_bytes` and
    `workspace_files` bound the workspace at every moment of the episode."""

    cpu_seconds: int = 10
    wall_seconds: float = 20.0
    memory_bytes: int = 1 << 30
    output_bytes: int = 64 * 1024
    file_bytes: int = 16 << 20
    max_processes: int = 64
    workspace_bytes: int = 64 << 20
    workspace_files: int = 10_000
    tmp_bytes: int = 64 << 20


@dataclasses.dataclass(frozen=True)
class CommandResult:
    """What a command did: exit status, (possibly truncated) merged stdout/stderr, why it was
    killed (None, "wall", "cpu", "output", "memory", "workspace") and how long it took."""

    returncode: int
    output: str
    killed_reason: str | None
    wall_seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_reason is None


class WorkspaceLimitError(RuntimeError):
    """A write or snapshot would exceed the workspace's size or file-count cap."""


def bwrap_available() -> bool:
    """True when bubblewrap exists and can build the sandbox here."""
    return isolation.usable("bwrap")


class Sandbox:
    """An episode's private workspace plus a way to run commands isolated inside it.

    Under bwrap and unshare the workspace is mounted at /workspace; under rlimit commands run in
    its real directory. `hidden_paths` (files or directories of the system view) are masked.
    """

    def __init__(
        self,
        workspace: Path,
        *,
        limits: SandboxLimits = SandboxLimits(),
        backend: str = "auto",
        require_isolation: bool = True,
        hidden_paths: tuple[str, ...] = (),
        owns_workspace: bool = True,
    ):
        self.backend = isolation.choose(backend, require_isolation)
        self.require_isolation = require_isolation
        if self.backend == "rlimit":
            _warn_once(
                "rlimit",
                "no isolating sandbox (bubblewrap or unshare) is in use: sandboxed commands run "
                "as plain subprocesses with limits. Time, memory, output and process limits "
                "hold, but there is NO filesystem, process or network isolation and hidden "
                "paths stay readable; fine for a quick local experiment only. To isolate: "
                + isolation.HOW_TO_ISOLATE,
            )
        if not cgroups.available():
            if os.geteuid() == 0 and require_isolation:
                raise IsolationUnavailable(
                    "running as root where no cgroup can be created: a sandboxed command could "
                    "start processes without limit (root is exempt from RLIMIT_NPROC); run as a "
                    "normal user, or give this process a writable cgroup (a delegated cgroup v2 "
                    "subtree, or a container with its own cgroup namespace)"
                )
            _warn_once(
                "cgroups",
                "no cgroup can be created here: memory and process caps apply per process "
                "(RLIMIT_AS / RLIMIT_NPROC), not to a command as a whole"
                + ("; as root there is NO process cap at all" if os.geteuid() == 0 else ""),
            )
        self.workspace = Path(workspace)
        self.limits = limits
        self.hidden_paths = tuple(hidden_paths)
        self._owns_workspace = owns_workspace

    @property
    def isolated(self) -> bool:
        return self.backend != "rlimit"

    @classmethod
    def from_files(cls, files: dict[str, str | bytes], root: str | None = None, **kwargs):
        """A sandbox whose fresh workspace holds `files` (relative path -> content)."""
        workspace = Path(tempfile.mkdtemp(prefix="cj_ws_", dir=root))
        try:
            write_files(workspace, files)
            return cls(workspace, **kwargs)
        except BaseException:
            shutil.rmtree(workspace, ignore_errors=True)
            raise

    def fork(self) -> "Sandbox":
        """A new sandbox with a copy of this workspace (for branching an episode)."""
        copy = Path(tempfile.mkdtemp(prefix="cj_ws_", dir=self.workspace.parent))
        shutil.copytree(self.workspace, copy, dirs_exist_ok=True, symlinks=True)
        return Sandbox(
            copy,
            limits=self.limits,
            backend=self.backend,
            require_isolation=self.require_isolation,
            hidden_paths=self.hidden_paths,
        )

    def usage(self) -> tuple[int, int]:
        """(bytes, entries) the workspace holds now; entries count files and directories."""
        states = _entry_states(self.workspace)
        return sum(size for size, _ in states.values()), len(states)

    def check_room(self, path: Path, new_bytes: int) -> None:
        """Raises WorkspaceLimitError if writing `new_bytes` to `path` would break a cap."""
        if new_bytes > self.limits.file_bytes:
            raise WorkspaceLimitError(
                f"{new_bytes} bytes is over the file size limit of {self.limits.file_bytes}"
            )
        size, entries = self.usage()
        old = path.stat().st_size if path.is_file() else 0
        if size - old + new_bytes > self.limits.workspace_bytes:
            raise WorkspaceLimitError(
                f"the workspace would hold {size - old + new_bytes} bytes, over its limit of "
                f"{self.limits.workspace_bytes}"
            )
        if not path.exists() and entries + 1 > self.limits.workspace_files:
            raise WorkspaceLimitError(
                f"the workspace is at its limit of {self.limits.workspace_files} entries"
            )

    def snapshot(self) -> dict[str, bytes]:
        """Every regular file of the workspace, by relative path (at most the workspace cap)."""
        return read_files(self.workspace, self.limits.workspace_bytes)

    def restore(self, snapshot: dict[str, bytes]) -> None:
        """Makes the workspace hold exactly `snapshot`."""
        shutil.rmtree(self.workspace)
        self.workspace.mkdir()
        write_files(self.workspace, snapshot)

    def close(self) -> None:
        if self._owns_workspace:
            shutil.rmtree(self.workspace, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def run(
        self,
        command: str,
        *,
        limits: SandboxLimits | None = None,
        extra_ro_binds: dict[str, str] | None = None,
        hidden_paths: tuple[str, ...] | None = None,
        stdin: str = "",
    ) -> CommandResult:
        """Runs a shell command in the workspace under the limits; never raises for what the
        command does. `extra_ro_binds` maps host paths to sandbox paths and `hidden_paths`
        replaces the sandbox's own for this command (isolating backends only)."""
        limits = limits or self.limits
        view = isolation.View(
            str(self.workspace),
            hidden=self.hidden_paths if hidden_paths is None else tuple(hidden_paths),
            ro_binds=tuple((extra_ro_binds or {}).items()),
            tmp_bytes=limits.tmp_bytes,
        )
        start = time.monotonic()
        cgroup = cgroups.CommandCgroup(limits.max_processes, limits.memory_bytes)
        try:
            before = _entry_states(self.workspace)
            argv = _launcher(limits, cgroup) + isolation.wrap(self.backend, view)
            argv += ["/bin/sh", "-c", command]
            try:
                proc = subprocess.Popen(
                    argv,
                    cwd=self.workspace,
                    env=_command_env(),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as error:
                return CommandResult(127, f"sandbox could not start: {error}", None, 0.0)
            try:
                output, killed = _collect(proc, stdin, limits, start, self._over_limit(limits))
            finally:
                _kill_group(proc)
                proc.wait()
                out_of_memory = cgroup.out_of_memory()
                cgroup.kill_and_remove()  # nothing of the command may still write while we trim
            code = proc.returncode
            if killed is None and out_of_memory:
                killed = "memory"
            cpu_killed = (
                -signal.SIGXCPU,
                -signal.SIGKILL,
                128 + signal.SIGXCPU,
                128 + signal.SIGKILL,
            )
            if killed is None and code in cpu_killed:
                killed = "cpu"
            text = output.decode("utf-8", errors="replace")
            removed = self._trim(before, limits)
            if removed:
                killed = killed or "workspace"
                text += (
                    f"\n[workspace limit ({limits.workspace_bytes} bytes, "
                    f"{limits.workspace_files} files): removed {', '.join(removed[:5])}"
                    f"{' ...' if len(removed) > 5 else ''}]"
                )
            return CommandResult(code, text, killed, time.monotonic() - start)
        finally:
            cgroup.kill_and_remove()

    def _over_limit(self, limits: SandboxLimits):
        def over() -> bool:
            size, files = self.usage()
            return size > limits.workspace_bytes or files > limits.workspace_files

        return over

    def _trim(self, before: dict, limits: SandboxLimits) -> list[str]:
        """Brings the workspace back under its caps after a command by removing what it made:
        new or changed files (largest first), then new directories (deepest first), then, only
        if that is not enough, anything else."""
        states = _entry_states(self.workspace)
        size, count = sum(s for s, _ in states.values()), len(states)
        if size <= limits.workspace_bytes and count <= limits.workspace_files:
            return []
        is_dir = {
            p: (self.workspace / p).is_dir() and not (self.workspace / p).is_symlink()
            for p in states
        }
        files = sorted(
            (p for p in states if not is_dir[p] and before.get(p) != states[p]),
            key=lambda p: -states[p][0],
        )
        dirs = sorted(
            (p for p in states if is_dir[p] and p not in before), key=lambda p: -p.count(os.sep)
        )
        rest = sorted(
            (p for p in states if p not in set(files) | set(dirs)),
            key=lambda p: (is_dir[p], -states[p][0]),
        )
        removed, gone = [], set()
        for path in files + dirs + rest:
            if size <= limits.workspace_bytes and count <= limits.workspace_files:
                break
            if path in gone:
                continue  # went with a directory removed before
            subtree = [
                q for q in states if (q == path or q.startswith(path + os.sep)) and q not in gone
            ]
            try:
                shutil.rmtree(self.workspace / path) if is_dir[path] else os.unlink(
                    self.workspace / path
                )
            except OSError:
                continue
            gone.update(subtree)
            size -= sum(states[q][0] for q in subtree)
            count -= len(subtree)
            removed.append(path)
        return removed


def _command_env() -> dict[str, str]:
    """The whole environment a command gets: nothing of the host process's."""
    return {
        "PATH": f"{Path(python_executable()).parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
    }


def _launcher(limits: SandboxLimits, cgroup: cgroups.CommandCgroup) -> list[str]:
    """The argv prefix that puts a command in its cgroup, ties it to the life of this process
    and sets its rlimits, then execs the backend."""
    argv = []
    if cgroup.attach_files:
        joins = "; ".join(f"echo $$ > {shlex.quote(f)}" for f in cgroup.attach_files)
        argv += ["/bin/sh", "-c", f'{joins}; exec "$@"', "cj_launch"]
    if setpriv := isolation.executable("setpriv"):
        argv += [setpriv, "--pdeathsig", "KILL", "--"]
    nproc = None
    if not cgroup.attach_files and os.getuid() != 0:
        # RLIMIT_NPROC counts every process of the user, so allow for those already running.
        nproc = _count_own_processes() + limits.max_processes
    if prlimit := isolation.executable("prlimit"):
        argv += [
            prlimit,
            f"--cpu={int(limits.cpu_seconds)}",
            f"--as={int(limits.memory_bytes)}",
            f"--fsize={int(limits.file_bytes)}",
            *([f"--nproc={nproc}"] if nproc else []),
            "--",
        ]
    else:
        prologue = [
            f"ulimit -t {int(limits.cpu_seconds)}",
            f"ulimit -v {limits.memory_bytes // 1024}",
            f"ulimit -f {max(1, limits.file_bytes // 512)}",
            'exec "$@"',
        ]
        argv += ["/bin/sh", "-c", "; ".join(prologue), "cj_limits"]
    return argv


def _count_own_processes() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def _entry_states(root: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime ns)} of every file and directory under root (directories
    have size 0), symlinks not followed."""
    states = {}
    for directory, dirs, files in os.walk(root):
        for name in files + dirs:
            path = os.path.join(directory, name)
            try:
                info = os.lstat(path)
            except OSError:
                continue
            size = 0 if name in dirs and not os.path.islink(path) else info.st_size
            states[os.path.relpath(path, root)] = (size, info.st_mtime_ns)
    return states


def _collect(proc, stdin: str, limits: SandboxLimits, start: float, over_limit):
    """Reads merged output until exit, killing on wall time, output overflow, or a workspace
    over its caps (checked every _WATCH_SECONDS)."""
    try:
        if stdin:
            proc.stdin.write(stdin.encode())
        proc.stdin.close()
    except OSError:
        pass
    chunks, size = [], 0
    next_watch = time.monotonic() + _WATCH_SECONDS
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            remaining = limits.wall_seconds - (now - start)
            if remaining <= 0:
                return b"".join(chunks), "wall"
            if now >= next_watch:
                if over_limit():
                    return b"".join(chunks), "workspace"
                next_watch = now + _WATCH_SECONDS
            if not selector.select(timeout=min(remaining, _WATCH_SECONDS)):
                continue
            data = os.read(proc.stdout.fileno(), 65536)
            if not data:
                break
            chunks.append(data)
            size += len(data)
            if size > limits.output_bytes:
                return b"".join(chunks)[: limits.output_bytes], "output"
    deadline = start + limits.wall_seconds
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return b"".join(chunks), "wall"
    return b"".join(chunks), None


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.stdout.close()


def _warn_once(key: str, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message)


def write_files(root: Path, files: dict[str, str | bytes]) -> None:
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content, encoding="utf-8")
        else:
            path.write_bytes(content)


def read_files(root: Path, max_bytes: int | None = None) -> dict[str, bytes]:
    """Every regular file under root by relative path; WorkspaceLimitError past `max_bytes`
    (checked before reading, so a huge workspace is never loaded)."""
    states = _entry_states(Path(root))
    total = sum(size for size, _ in states.values())
    if max_bytes is not None and total > max_bytes:
        raise WorkspaceLimitError(f"{root} holds {total} bytes, over the limit of {max_bytes}")
    files = {}
    for relative in sorted(states):
        path = Path(root) / relative
        if path.is_file() and not path.is_symlink():
            files[relative] = path.read_bytes()
    return files
