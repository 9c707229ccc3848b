"""Per-episode workspaces and isolated command execution.

Commands run under bubblewrap (no network, read-only system, private /tmp, only the workspace
writable, chosen paths hidden). Without bwrap they fall back to a plain subprocess with resource
limits, which bounds time, memory, output and processes but cannot isolate the filesystem or the
network: a warning says so once. Limits are applied by a tiny shell prologue (`ulimit`) rather than
`preexec_fn`, which is unsafe when many episodes run in threads.
"""

import dataclasses
import functools
import logging
import os
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

WORKSPACE_MOUNT = "/workspace"
_SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib64", "/sbin", "/etc")
_warned_fallback = False
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one command."""

    cpu_seconds: int = 10
    wall_seconds: float = 20.0
    memory_bytes: int = 1 << 30
    output_bytes: int = 64 * 1024
    file_bytes: int = 16 << 20
    max_processes: int = 64


@dataclasses.dataclass(frozen=True)
class CommandResult:
    """What a command did: exit status, (possibly truncated) merged stdout/stderr, why it was
    killed (None, "wall", "cpu", "output") and how long it took."""

    returncode: int
    output: str
    killed_reason: str | None
    wall_seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_reason is None


@functools.cache
def bwrap_available() -> bool:
    """True when bwrap exists and can build the sandbox here (user namespaces, mounting /proc
    and the like can be forbidden in containers). Probed once with the real arguments."""
    if shutil.which("bwrap") is None:
        return False
    with tempfile.TemporaryDirectory(prefix="cj_probe_") as workspace:
        argv = _bwrap_args(workspace, (), {}) + ["/bin/sh", "-c", "true"]
        try:
            probe = subprocess.run(argv, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
    return probe.returncode == 0


def python_executable() -> str:
    """The base interpreter (not a virtualenv's), so sandboxed code sees only the stdlib."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidate = Path(sys.base_prefix) / "bin" / version
    return str(candidate) if candidate.exists() else sys.executable


def _system_binds() -> list[str]:
    args = []
    for path in (*_SYSTEM_DIRS, sys.base_prefix):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            args += ["--ro-bind", path, path]
    return args


@functools.cache
def _pids_cgroup_root() -> Path | None:
    """Where we may create pids-controller cgroups (v1 or v2), or None."""
    for candidate in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
        probe = candidate / f"composer_jax_probe_{os.getpid()}"
        try:
            probe.mkdir()
            usable = (probe / "pids.max").exists()
            probe.rmdir()
        except OSError:
            continue
        if usable:
            return candidate
    return None


class _PidsCgroup:
    """A pids-controller cgroup bounding a command's process count (fork bombs), when the host
    lets us create one; as root RLIMIT_NPROC is not enforced, so this is the real bound."""

    def __init__(self, max_processes: int):
        root = _pids_cgroup_root()
        self.path = None
        if root is not None:
            path = root / f"composer_jax_{os.getpid()}_{uuid.uuid4().hex[:12]}"
            try:
                path.mkdir()
                (path / "pids.max").write_text(str(max_processes))
                self.path = path
            except OSError:
                self.path = None

    def kill_and_remove(self) -> None:
        if self.path is None:
            return
        for _ in range(50):
            try:
                pids = (self.path / "cgroup.procs").read_text().split()
            except OSError:
                pids = []
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.02)
        log.warning("could not remove cgroup %s", self.path)


class Sandbox:
    """An episode's private workspace plus a way to run commands isolated inside it.

    Inside bwrap the workspace is mounted at /workspace; in the fallback commands run in its real
    directory. `hidden_paths` (files or directories) are masked inside bwrap.
    """

    def __init__(
        self,
        workspace: Path,
        *,
        limits: SandboxLimits = SandboxLimits(),
        backend: str = "auto",
        hidden_paths: tuple[str, ...] = (),
        owns_workspace: bool = True,
    ):
        if backend not in ("auto", "bwrap", "rlimit"):
            raise ValueError(f"backend must be auto, bwrap or rlimit, got {backend!r}")
        if backend == "auto":
            backend = "bwrap" if bwrap_available() else "rlimit"
        if backend == "bwrap" and not bwrap_available():
            raise RuntimeError("bwrap requested but not usable on this host")
        if backend == "rlimit":
            _warn_fallback_once()
        self.workspace = Path(workspace)
        self.limits = limits
        self.backend = backend
        self.hidden_paths = tuple(hidden_paths)
        self._owns_workspace = owns_workspace

    @classmethod
    def from_files(cls, files: dict[str, str | bytes], root: str | None = None, **kwargs):
        """A sandbox whose fresh workspace holds `files` (relative path -> content)."""
        workspace = Path(tempfile.mkdtemp(prefix="cj_ws_", dir=root))
        write_files(workspace, files)
        return cls(workspace, **kwargs)

    def fork(self) -> "Sandbox":
        """A new sandbox with a copy of this workspace (for branching an episode)."""
        copy = Path(tempfile.mkdtemp(prefix="cj_ws_", dir=self.workspace.parent))
        shutil.copytree(self.workspace, copy, dirs_exist_ok=True, symlinks=True)
        return Sandbox(
            copy, limits=self.limits, backend=self.backend, hidden_paths=self.hidden_paths
        )

    def snapshot(self) -> dict[str, bytes]:
        """Every regular file of the workspace, by relative path."""
        return read_files(self.workspace)

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
        replaces the sandbox's own for this command (both bwrap only)."""
        limits = limits or self.limits
        hidden = self.hidden_paths if hidden_paths is None else hidden_paths
        cgroup = _PidsCgroup(limits.max_processes)
        argv = self._argv(command, limits, cgroup, extra_ro_binds or {}, hidden)
        env = {
            "PATH": f"{Path(python_executable()).parent}:/usr/bin:/bin",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
        }
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                cwd=self.workspace,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as error:
            cgroup.kill_and_remove()
            return CommandResult(127, f"sandbox could not start: {error}", None, 0.0)
        try:
            output, killed = _collect(proc, stdin, limits, start)
        finally:
            _kill_group(proc)
            proc.wait()
            cgroup.kill_and_remove()
        code = proc.returncode
        cpu_killed = (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL)
        if killed is None and code in cpu_killed:
            killed = "cpu"
        text = output.decode("utf-8", errors="replace")
        return CommandResult(code, text, killed, time.monotonic() - start)

    def _argv(self, command, limits, cgroup, extra_ro_binds, hidden_paths) -> list[str]:
        prologue = [
            f"ulimit -t {int(limits.cpu_seconds)}",
            f"ulimit -v {limits.memory_bytes // 1024}",
            f"ulimit -f {max(1, limits.file_bytes // 512)}",
        ]
        if cgroup.path is not None:
            prologue.append(f"echo $$ > {shlex.quote(str(cgroup.path / 'cgroup.procs'))}")
        elif os.getuid() != 0:
            # RLIMIT_NPROC counts every process of the user, so allow for those already running.
            prologue.append(f"ulimit -u {_count_own_processes() + limits.max_processes}")
        prologue.append('exec "$@"')
        launcher = ["/bin/sh", "-c", "; ".join(prologue), "sh"]
        inner = ["/bin/sh", "-c", command]
        if self.backend == "rlimit":
            return launcher + inner
        args = _bwrap_args(str(self.workspace), hidden_paths, extra_ro_binds)
        return launcher + args + inner


_empty_path: str | None = None


def _empty_file() -> str:
    """An empty read-only file to mount over hidden files (a /dev/null bind is not openable
    when bwrap mounts it nodev)."""
    global _empty_path
    with _lock:
        if _empty_path is None or not os.path.exists(_empty_path):
            handle, path = tempfile.mkstemp(prefix="cj_empty_")
            os.close(handle)
            os.chmod(path, 0o444)
            _empty_path = path
    return _empty_path


def _bwrap_args(workspace: str, hidden_paths, extra_ro_binds: dict[str, str]) -> list[str]:
    args = ["bwrap", *_system_binds()]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    args += ["--bind", workspace, WORKSPACE_MOUNT, "--chdir", WORKSPACE_MOUNT]
    for hidden in hidden_paths:
        if not os.path.exists(hidden) or not _under_bound_tree(hidden):
            continue
        if os.path.isdir(hidden):
            args += ["--tmpfs", hidden, "--remount-ro", hidden]
        else:
            args += ["--ro-bind", _empty_file(), hidden]
    for host, inside in extra_ro_binds.items():
        args += ["--ro-bind", host, inside]
    args += ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    return args


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


def _under_bound_tree(path: str) -> bool:
    real = os.path.realpath(path)
    roots = [os.path.realpath(p) for p in (*_SYSTEM_DIRS, sys.base_prefix)]
    return any(real == root or real.startswith(root + os.sep) for root in roots)


def _collect(proc, stdin: str, limits: SandboxLimits, start: float):
    """Reads merged output until exit, killing on wall time or output overflow."""
    try:
        if stdin:
            proc.stdin.write(stdin.encode())
        proc.stdin.close()
    except OSError:
        pass
    chunks, size = [], 0
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while True:
            remaining = limits.wall_seconds - (time.monotonic() - start)
            if remaining <= 0:
                return b"".join(chunks), "wall"
            if not selector.select(timeout=min(remaining, 0.5)):
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


def _warn_fallback_once() -> None:
    global _warned_fallback
    with _lock:
        if not _warned_fallback:
            _warned_fallback = True
            log.warning(
                "bubblewrap (bwrap) is not usable here: sandboxed commands fall back to a plain "
                "subprocess with rlimits. Time, memory, output and process limits still hold, "
                "but there is NO filesystem or network isolation and hidden paths stay readable; "
                "install bubblewrap (apt-get install -y bubblewrap) for real isolation."
            )


def write_files(root: Path, files: dict[str, str | bytes]) -> None:
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content, encoding="utf-8")
        else:
            path.write_bytes(content)


def read_files(root: Path) -> dict[str, bytes]:
    files = {}
    for path in sorted(Path(root).rglob("*")):
        if path.is_file() and not path.is_symlink():
            files[str(path.relative_to(root))] = path.read_bytes()
    return files
