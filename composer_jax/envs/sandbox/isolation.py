"""How a sandboxed command is cut off from the host: the argv that wraps it.

Backends, strongest first:
- `bwrap` (bubblewrap): user, PID, mount, network, IPC and UTS namespaces; the command sees a
  read-only system (/usr and the interpreter), a few harmless /etc files, a private /proc, /dev and
  size-capped /tmp, and the workspace; nothing else of the host.
- `unshare` (util-linux, on every Linux): the same namespaces and the same view, built by
  `_mount_root` (one interpreter making the mount calls) as root of a fresh user namespace, then
  `pivot_root` into it and every capability dropped (no_new_privs). Needs unprivileged user
  namespaces (or root).
- `rlimit`: no isolation, only limits. Model-written code can read and write whatever the host user
  can; for quick local experiments only, and refused where isolation is required.

Every backend runs the command under a launcher that joins its cgroup (when one can be made),
dies with its parent (`setpriv --pdeathsig`) and sets per-process rlimits (`prlimit`).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from composer_jax.envs.sandbox import _mount_root

BACKENDS = ("bwrap", "unshare", "rlimit")
WORKSPACE_MOUNT = "/workspace"
HOW_TO_ISOLATE = (
    "install bubblewrap (apt-get install bubblewrap / dnf install bubblewrap), or allow "
    "unprivileged user namespaces for util-linux unshare (sysctl kernel.unprivileged_userns_clone=1;"
    " on Ubuntu 24.04+ kernel.apparmor_restrict_unprivileged_userns=0); for a quick local "
    "experiment without isolation set require_isolation=False (--config.rl.agent.require_sandbox=False)"
)

# Host directories the sandbox sees read-only (symlinks, as on merged-/usr systems, stay links).
_SYSTEM_DIRS = ("/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin")
# The only host /etc entries bound: what the dynamic loader and a few tools read. No account,
# password-hash, host-name or network configuration.
_ETC_ENTRIES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/localtime",
)
# Made-up account files, so tools that look up a user name find one.
_SYNTHETIC_ETC = {
    "passwd": "root:x:0:0:root:/tmp:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost\n",
}
_TOOL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_lock = threading.Lock()


class IsolationUnavailable(RuntimeError):
    """Isolation is required but no isolating backend works on this host."""


@functools.cache
def executable(name: str) -> str | None:
    """The absolute path of a host program, resolved once (the sandbox's PATH differs from the
    host's, so a program is always launched by this path)."""
    found = shutil.which(name) or shutil.which(name, path=_TOOL_PATH)
    return os.path.abspath(found) if found else None


@dataclasses.dataclass(frozen=True)
class View:
    """What a sandboxed command sees: the workspace (read-write), `hidden` host paths masked,
    `ro_binds` (host path -> sandbox path) added, and a /tmp of at most `tmp_bytes`."""

    workspace: str
    hidden: tuple[str, ...] = ()
    ro_binds: tuple[tuple[str, str], ...] = ()
    tmp_bytes: int = 64 << 20


def interpreter_prefix() -> str:
    """Where the base interpreter lives (bound read-only so sandboxed code can run Python)."""
    return os.path.realpath(sys.base_prefix)


def _system_entries() -> list[tuple[str, str | None]]:
    """(sandbox path, symlink target or None for a read-only bind) of the system view."""
    entries = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            entries.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            entries.append((path, None))
    prefix = interpreter_prefix()
    if not any(prefix == d or prefix.startswith(d + "/") for d, _ in entries):
        entries.append((prefix, None))
    for path in _ETC_ENTRIES:
        if os.path.islink(path):
            entries.append((path, os.readlink(path)))
        elif os.path.exists(path):
            entries.append((path, None))
    return entries


def process_temp_dir(prefix: str) -> str:
    """A temporary host folder that lives as long as this process (removed at exit)."""
    directory = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


_synthetic_dir: str | None = None
_SYNTHETIC_FILES = {**_SYNTHETIC_ETC, "empty": ""}


def _synthetic_etc() -> str:
    """A host folder holding the made-up /etc files (bwrap binds them), one per user and
    content, shared by every process and kept: a folder per process outlived each process
    killed before its exit handlers ran (sandbox workers are), one more in /tmp each time."""
    global _synthetic_dir
    with _lock:
        if _synthetic_dir is None or not _is_synthetic_etc(_synthetic_dir):
            _synthetic_dir = _shared_synthetic_etc()
    return _synthetic_dir


def _is_synthetic_etc(directory: str) -> bool:
    """Whether `directory` is this user's, writable by no one else, and holds exactly the
    made-up files, read-only: a folder another user placed at the shared name is not used."""
    uid = os.getuid()
    try:
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o022:
            return False
        if sorted(os.listdir(directory)) != sorted(_SYNTHETIC_FILES):
            return False
        for name, text in _SYNTHETIC_FILES.items():
            path = os.path.join(directory, name)
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != uid or info.st_mode & 0o222:
                return False
            with open(path) as f:
                if f.read() != text:
                    return False
    except OSError:
        return False
    return True


def _shared_synthetic_etc() -> str:
    """The shared folder, made atomically (written aside, then renamed into place); when its
    name holds anything else, this process's own folder, removed at exit."""
    digest = hashlib.sha256(repr(sorted(_SYNTHETIC_FILES.items())).encode()).hexdigest()[:16]
    shared = os.path.join(tempfile.gettempdir(), f"cj_etc_{os.getuid()}_{digest}")
    if _is_synthetic_etc(shared):
        return shared
    staging = tempfile.mkdtemp(prefix="cj_etc_")
    for name, text in _SYNTHETIC_FILES.items():
        with open(os.path.join(staging, name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(staging, name), 0o444)
    try:
        os.rename(staging, shared)  # fails when another process's folder is there already
    except OSError:
        pass
    if _is_synthetic_etc(shared):
        shutil.rmtree(staging, ignore_errors=True)
        return shared
    atexit.register(shutil.rmtree, staging, ignore_errors=True)
    return staging


def system_roots() -> list[str]:
    """The host folders of the sandbox's read-only system view (real paths, none inside
    another): where a copy of something to hide could be."""
    real = sorted(
        {os.path.realpath(p) for p, link in _system_entries() if link is None and os.path.isdir(p)}
    )
    return [r for r in real if not any(r.startswith(o + os.sep) for o in real)]


def visible(path: str) -> bool:
    """Whether a host path is inside the sandbox's system view (so hiding it means something)."""
    real = os.path.realpath(path)
    roots = [os.path.realpath(p) for p, _ in _system_entries()]
    return any(real == root or real.startswith(root + os.sep) for root in roots)


def bwrap_argv(view: View) -> list[str]:
    args = [
        executable("bwrap") or "bwrap",
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
    ]
    for path, link in _system_entries():
        args += ["--symlink", link, path] if link is not None else ["--ro-bind", path, path]
    etc = _synthetic_etc()
    for name in _SYNTHETIC_ETC:
        args += ["--ro-bind", os.path.join(etc, name), f"/etc/{name}"]
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(view.tmp_bytes), "--tmpfs", "/tmp"]
    args += ["--bind", view.workspace, WORKSPACE_MOUNT]
    for path in view.hidden:
        if not os.path.exists(path) or not visible(path):
            continue
        if os.path.isdir(path):
            args += ["--tmpfs", path, "--remount-ro", path]
        else:
            args += ["--ro-bind", os.path.join(etc, "empty"), path]
    for host, inside in view.ro_binds:
        args += ["--ro-bind", host, inside]
    args += ["--remount-ro", "/", "--chdir", WORKSPACE_MOUNT, "--"]
    return args


_new_root: str | None = None


def _new_root_mountpoint() -> str:
    """An empty host folder; each command mounts its own root there inside its private mount
    namespace, so one folder serves every command at once."""
    global _new_root
    with _lock:
        if _new_root is None or not os.path.isdir(_new_root):
            _new_root = process_temp_dir("cj_root_")
    return _new_root


def unshare_steps(view: View, root: str) -> list[str]:
    """The steps `_mount_root` takes to build the sandbox's root at `root` (see its docstring)."""
    steps = ["mount", "cj_root", root, "tmpfs", "-", "size=1m,mode=0755"]

    def read_only_bind(host: str, inside: str) -> None:
        target = root + inside
        if os.path.isdir(host):
            steps.extend(["mkdir", target, "mount", host, target, "-", "bind,rec", "-"])
        else:
            steps.extend(["mkdir", os.path.dirname(target), "file", target, "644", ""])
            steps.extend(["mount", host, target, "-", "bind", "-"])
        steps.extend(["readonly", target])

    for path, link in _system_entries():
        if link is not None:
            steps.extend(["mkdir", root + os.path.dirname(path), "symlink", link, root + path])
        else:
            read_only_bind(path, path)
    for folder in ("etc", "proc", "dev", "tmp", WORKSPACE_MOUNT.strip("/"), ".old"):
        steps.extend(["mkdir", f"{root}/{folder}"])
    steps.extend(["file", f"{root}/.empty", "444", ""])
    for name, text in _SYNTHETIC_ETC.items():
        steps.extend(["file", f"{root}/etc/{name}", "644", text])
    steps.extend(["mount", "proc", f"{root}/proc", "proc", "nosuid,nodev,noexec", "-"])
    for device in ("null", "zero", "full", "random", "urandom"):
        if os.path.exists(f"/dev/{device}"):
            target = f"{root}/dev/{device}"
            steps.extend(["file", target, "644", ""])
            steps.extend(["mount", f"/dev/{device}", target, "-", "bind", "-"])
    for name, fd in (("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")):
        steps.extend(["symlink", f"/proc/self/fd{fd}", f"{root}/dev/{name}"])
    tmp_options = f"size={int(view.tmp_bytes)},mode=1777"
    steps.extend(["mount", "cj_tmp", f"{root}/tmp", "tmpfs", "nosuid,nodev", tmp_options])
    # POSIX semaphores (multiprocessing's locks) live in /dev/shm, which bwrap's --dev has too.
    steps.extend(["mkdir", f"{root}/dev/shm"])
    steps.extend(["mount", "cj_shm", f"{root}/dev/shm", "tmpfs", "nosuid,nodev", tmp_options])
    steps.extend(["mount", view.workspace, root + WORKSPACE_MOUNT, "-", "bind", "-"])
    for path in view.hidden:
        if not os.path.exists(path) or not visible(path):
            continue
        if os.path.isdir(path):
            steps.extend(
                ["mount", "cj_hidden", root + path, "tmpfs", "rdonly", "size=4k,mode=0555"]
            )
        else:
            steps.extend(["mount", f"{root}/.empty", root + path, "-", "bind", "-"])
    for host, inside in view.ro_binds:
        read_only_bind(host, inside)
    return steps


_MOUNT_ROOT_SOURCE = Path(_mount_root.__file__).read_text(encoding="utf-8")


def python_executable() -> str:
    """The base interpreter (not a virtualenv's): sandboxed code sees only the stdlib."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidate = os.path.join(sys.base_prefix, "bin", version)
    return candidate if os.path.exists(candidate) else sys.executable


def unshare_argv(view: View) -> list[str]:
    root = _new_root_mountpoint()
    return [
        executable("unshare") or "unshare",
        "--user",
        "--map-root-user",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount",
        "--net",
        "--ipc",
        "--uts",
        "--propagation",
        "private",
        python_executable(),
        "-I",
        "-S",
        "-B",
        "-c",
        _MOUNT_ROOT_SOURCE + "\nmain(sys.argv[1:])\n",
        root,
        executable("pivot_root") or "pivot_root",
        *unshare_steps(view, root),
        "--",
        # A session of its own: a signal to "process group 0" cannot reach the launcher.
        executable("setsid") or "setsid",
        executable("setpriv") or "setpriv",
        "--no-new-privs",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]


def wrap(backend: str, view: View) -> list[str]:
    """The argv prefix that runs a command (appended after it) isolated by `backend`."""
    if backend == "bwrap":
        return bwrap_argv(view)
    if backend == "unshare":
        return unshare_argv(view)
    if backend == "rlimit":
        return []
    raise ValueError(f"unknown sandbox backend {backend!r}; choose from {BACKENDS}")


@functools.cache
def usable(backend: str) -> bool:
    """Whether `backend` can build its sandbox on this host: probed once, with the real
    arguments, by running a command that must see the workspace and not the host."""
    if backend == "rlimit":
        return True
    needed = {
        "bwrap": ("bwrap",),
        "unshare": ("unshare", "setpriv", "setsid", "pivot_root"),
    }
    if backend not in needed or not all(executable(n) for n in needed[backend]):
        return False
    with tempfile.TemporaryDirectory(prefix="cj_probe_") as workspace:
        with open(os.path.join(workspace, "probe"), "w") as f:
            f.write("ok")
        check = f'test "$(cat {WORKSPACE_MOUNT}/probe)" = ok && test ! -e /etc/shadow'
        argv = wrap(backend, View(workspace)) + ["/bin/sh", "-c", check]
        try:
            probe = subprocess.run(
                argv, capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"}
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
    return probe.returncode == 0


def choose(requested: str, require_isolation: bool) -> str:
    """The backend to use: `requested`, or for "auto" the strongest usable one. Raises
    IsolationUnavailable when isolation is required and the choice would not isolate."""
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"sandbox backend must be auto or one of {BACKENDS}, got {requested!r}")
    if requested == "auto":
        requested = next(b for b in BACKENDS if usable(b))
        if requested == "rlimit" and require_isolation:
            raise IsolationUnavailable(
                "model-written code must run isolated (require_isolation is on) but neither "
                "bubblewrap nor unshare works here: " + HOW_TO_ISOLATE
            )
    elif not usable(requested):
        raise IsolationUnavailable(
            f"sandbox backend {requested!r} is not usable on this host: " + HOW_TO_ISOLATE
        )
    elif requested == "rlimit" and require_isolation:
        raise IsolationUnavailable(
            "the rlimit backend does not isolate model-written code, and require_isolation is "
            "on: use auto, bwrap or unshare (" + HOW_TO_ISOLATE + ")"
        )
    return requested
