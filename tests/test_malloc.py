"""The compute entry points run themselves again under glibc malloc tunables (launch/malloc.py)."""

import os
import subprocess
import sys

import pytest

from launch import malloc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    not malloc._glibc(), reason="the tunables are glibc's; other C libraries are left alone"
)

_PROBE = (
    "import os, sys\n"
    "print('start', os.getpid(), flush=True)\n"
    "from launch import malloc\n"
    "malloc.exec_with_tunables()\n"
    "print('tunables', repr(os.environ.get('GLIBC_TUNABLES')), os.getpid(), sys.argv[1:])\n"
)


def _python(*args: str, tunables: str | None = None) -> list[str]:
    """stdout lines of `python ARGS` in the repository, GLIBC_TUNABLES set to `tunables`
    (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    out = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_runs_again_once_with_the_tunables_same_pid_and_arguments():
    first, second, last = _python("-c", _PROBE, "--flag=1", "x")
    assert first.startswith("start") and second.startswith("start")  # the program ran twice
    pid = first.split()[1]
    assert second.split()[1] == pid  # exec, not a child process
    assert last == f"tunables {malloc.TUNABLES!r} {pid} ['--flag=1', 'x']"


@pytest.mark.parametrize("users", ["", "glibc.malloc.arena_max=1"])
def test_leaves_a_users_setting_alone(users):
    start, last = _python("-c", _PROBE, tunables=users)
    assert last.startswith(f"tunables {users!r} {start.split()[1]}")


def test_the_main_job_prints_its_config_once():
    """An entry point's own output is not repeated by the exec (it happens before main)."""
    out = _python("-m", "launch.rl", "--print_config")
    assert "\n".join(out).count('"workdir"') == 1
