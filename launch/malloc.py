"""glibc malloc settings for the entry points that compute on XLA:CPU.

XLA:CPU allocates an executable's temporaries afresh on every call (hundreds of MB for a training
step of the tiny model). glibc serves an allocation over its mmap threshold with a new mapping and
hands freed heap back to the kernel, so each step page-faults all of its buffers in again: about
150,000 faults per SFT step of `rl_tiny`, a fifth of the job's CPU time spent in the kernel.
Transparent huge pages for malloc's mappings (`glibc.malloc.hugetlb=1`, glibc >= 2.35), a 32 MiB
mmap threshold and a trim threshold that keeps freed memory cut this to about 2,000 faults per
step (experiments/RESULTS.md, "XLA:CPU time").

glibc reads tunables only when a process starts, so an entry point run as a program executes
itself again, once, with them set. A `GLIBC_TUNABLES` already in the environment (even empty) is
the user's choice and is left alone; other C libraries are left alone too.
"""

from __future__ import annotations

import os
import sys

TUNABLES = ":".join(
    (
        "glibc.malloc.hugetlb=1",
        "glibc.malloc.mmap_threshold=33554432",  # glibc's largest (HEAP_MAX_SIZE / 2)
        "glibc.malloc.trim_threshold=4294967296",
    )
)


def _glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no confstr, or not a GNU C library
        return False


def exec_with_tunables() -> None:
    """Replaces this process with itself (same interpreter, command line and pid) under
    `TUNABLES`, unless GLIBC_TUNABLES is set or the C library is not glibc. Call it first thing
    in an entry point's `__main__` block, before threads or files are opened."""
    if "GLIBC_TUNABLES" in os.environ or not sys.orig_argv or not _glibc():
        return
    env = dict(os.environ, GLIBC_TUNABLES=TUNABLES)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
