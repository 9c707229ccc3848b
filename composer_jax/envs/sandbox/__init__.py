"""The sandbox room: per-episode workspaces and commands run isolated and under limits.

`box` (`Sandbox`, its limits and results), `isolation` (the backends' argv: bubblewrap, unshare,
the unisolated rlimit fallback), `cgroups` (a command's process and memory cgroup; `sweep` for a
dead worker's leftovers); `_mount_root` is private (the source `isolation` ships into unshare).

The bottom room: it imports nothing of `envs/` outside itself (not `tools`, `grading`, `tasks`
nor the top-level modules).
"""

from composer_jax.envs.sandbox.box import (
    CommandResult,
    Sandbox,
    SandboxLimits,
    WorkspaceLimitError,
    bwrap_available,
    read_files,
    write_files,
)
from composer_jax.envs.sandbox.isolation import (
    WORKSPACE_MOUNT,
    IsolationUnavailable,
    python_executable,
)

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
