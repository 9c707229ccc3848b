"""Control groups for sandboxed commands: a process cap and a memory cap on the whole command
(every process it starts), a reliable way to kill all of it, and no leftovers.

Per-process rlimits cannot bound a command (three 700 MB processes pass a 1 GiB RLIMIT_AS each),
and as root RLIMIT_NPROC is not enforced at all; a cgroup bounds the sum. Both layouts are handled:
cgroup v1 (a `pids` and a `memory` hierarchy) and v2 (one unified hierarchy with the controllers
enabled for our subtree). Where neither can be created (no delegation, read-only /sys) the command
runs without one and `available()` says so; the sandbox then falls back to rlimits.

A cgroup's name carries the pid of the process that made it, so when an environment worker dies,
its parent can kill and remove what it left (`sweep`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

_ROOT = Path("/sys/fs/cgroup")
_PREFIX = "composer_jax_"


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where command cgroups are made: one parent per hierarchy (v1: pids and memory; v2: one)."""

    version: int
    pids_parent: Path
    memory_parent: Path

    @property
    def parents(self) -> tuple[Path, ...]:
        return tuple(dict.fromkeys((self.pids_parent, self.memory_parent)))


def _own_cgroup(controller: str | None) -> str:
    """This process's path in the hierarchy of `controller` (None: the v2 unified one)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "/"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",") if controllers else []
        if (controller is None and not names) or controller in names:
            return path
    return "/"


def _try_child(parent: Path, files: tuple[str, ...]) -> bool:
    """Whether a child cgroup of `parent` gets `files` (its controllers are enabled there)."""
    probe = parent / f"{_PREFIX}probe_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    try:
        probe.mkdir()
    except OSError:
        return False
    try:
        return all((probe / name).exists() for name in files)
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass


def _candidates(hierarchy: Path, controller: str | None) -> list[Path]:
    """Our own cgroup first (keeps the accounting nested under whatever limits us), then the
    hierarchy's root."""
    own = hierarchy / _own_cgroup(controller).lstrip("/")
    return list(dict.fromkeys((own, hierarchy)))


@functools.cache
def _layout() -> _Layout | None:
    pids_v1, memory_v1 = _ROOT / "pids", _ROOT / "memory"
    if (pids_v1 / "cgroup.procs").exists() and (memory_v1 / "cgroup.procs").exists():
        pids = next((p for p in _candidates(pids_v1, "pids") if _try_child(p, ("pids.max",))), None)
        memory = next(
            (
                p
                for p in _candidates(memory_v1, "memory")
                if _try_child(p, ("memory.limit_in_bytes",))
            ),
            None,
        )
        if pids is not None and memory is not None:
            return _Layout(1, pids, memory)
    for hierarchy in (_ROOT, _ROOT / "unified"):
        if not (hierarchy / "cgroup.controllers").exists():
            continue
        for parent in _candidates(hierarchy, None):
            if not _try_child(parent, ("pids.max", "memory.max")):
                try:  # Enabling works where the parent holds no processes itself.
                    (parent / "cgroup.subtree_control").write_text("+pids +memory")
                except OSError:
                    continue
                if not _try_child(parent, ("pids.max", "memory.max")):
                    continue
            return _Layout(2, parent, parent)
    return None


def available() -> bool:
    """Whether commands get a cgroup (process and memory caps over the whole command)."""
    return _layout() is not None


class CommandCgroup:
    """The cgroup(s) of one command: `attach_files` are written with the command's pid before it
    execs, so everything it starts is counted, capped and killed together."""

    def __init__(self, max_processes: int, memory_bytes: int):
        self.layout = _layout()
        self.paths: tuple[Path, ...] = ()
        if self.layout is None:
            return
        name = f"{_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:12]}"
        made = []
        try:
            for parent in self.layout.parents:
                path = parent / name
                path.mkdir()
                made.append(path)
            if self.layout.version == 1:
                pids, memory = made[0], made[-1]
                (pids / "pids.max").write_text(str(max_processes))
                (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
                _write_if_present(memory / "memory.memsw.limit_in_bytes", str(memory_bytes))
            else:
                (made[0] / "pids.max").write_text(str(max_processes))
                (made[0] / "memory.max").write_text(str(memory_bytes))
                _write_if_present(made[0] / "memory.swap.max", "0")
        except OSError as error:
            log.warning("could not set up a command cgroup (%s); running without one", error)
            for path in made:
                _kill_and_remove(path)
            return
        self.paths = tuple(made)

    @property
    def attach_files(self) -> tuple[str, ...]:
        return tuple(str(path / "cgroup.procs") for path in self.paths)

    def out_of_memory(self) -> bool:
        """Whether the kernel killed a process of the command for exceeding the memory cap."""
        if not self.paths:
            return False
        memory = self.paths[-1]
        events = "memory.oom_control" if self.layout.version == 1 else "memory.events"
        try:
            for line in (memory / events).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
        except (OSError, ValueError):
            pass
        return False

    def kill_and_remove(self) -> None:
        for path in self.paths:
            _kill_and_remove(path)
        self.paths = ()


def _write_if_present(path: Path, value: str) -> None:
    if path.exists():
        try:
            path.write_text(value)
        except OSError:
            pass


def _kill_and_remove(path: Path) -> None:
    """SIGKILLs every process in the cgroup until it is empty, then removes it."""
    kill_file = path / "cgroup.kill"  # v2, Linux 5.14+: one write kills the whole subtree
    for _ in range(100):
        if kill_file.exists():
            try:
                kill_file.write_text("1")
            except OSError:
                pass
        try:
            pids = (path / "cgroup.procs").read_text().split()
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError, PermissionError):
                pass
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
    log.warning("could not remove cgroup %s", path)


def sweep(owner_pid: int) -> int:
    """Kills and removes the command cgroups a (dead) process `owner_pid` left; returns how many.
    An environment pool calls this when it replaces a crashed or hung worker, so the commands
    that worker was running cannot outlive it."""
    layout = _layout()
    if layout is None:
        return 0
    removed = 0
    for parent in layout.parents:
        for path in parent.glob(f"{_PREFIX}{owner_pid}_*"):
            _kill_and_remove(path)
            removed += 1
    return removed
