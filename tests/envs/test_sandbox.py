"""Sandbox isolation and limits. bwrap-only properties are skipped when bwrap is unusable; the
limits (time, memory, output, processes) are checked on both backends."""

import logging
import os
import subprocess

import pytest

from composer_jax.envs import sandbox as sandbox_module
from composer_jax.envs.sandbox import Sandbox, SandboxLimits, bwrap_available

BACKENDS = [
    pytest.param("bwrap", marks=pytest.mark.skipif(not bwrap_available(), reason="no bwrap")),
    "rlimit",
]
FAST = SandboxLimits(cpu_seconds=2, wall_seconds=4, memory_bytes=512 << 20, max_processes=32)
needs_bwrap = pytest.mark.skipif(not bwrap_available(), reason="bwrap not usable here")


@pytest.fixture(params=BACKENDS)
def sandbox(request, tmp_path):
    box = Sandbox.from_files(
        {"a.txt": "hello"}, root=str(tmp_path), backend=request.param, limits=FAST
    )
    yield box
    box.close()


def test_runs_in_workspace(sandbox):
    result = sandbox.run("cat a.txt && echo more > b.txt")
    assert result.ok and result.output == "hello"
    assert (sandbox.workspace / "b.txt").read_text() == "more\n"


@needs_bwrap
def test_cannot_write_outside_workspace(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    with Sandbox.from_files({}, root=str(tmp_path), backend="bwrap") as box:
        result = box.run(
            f"echo x > {outside}/f; echo y > /etc/cj_probe; echo z > /tmp/ok; cat /tmp/ok"
        )
    assert not (outside / "f").exists() and not os.path.exists("/etc/cj_probe")
    assert "Read-only file system" in result.output or "No such file" in result.output
    assert result.output.strip().endswith("z")  # private /tmp is writable


@needs_bwrap
def test_cannot_open_a_socket():
    code = "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2); print('open')"
    with Sandbox.from_files({}, backend="bwrap") as box:
        result = box.run(f'python3 -c "{code}"')
    assert "open" not in result.output and result.returncode != 0


@needs_bwrap
def test_hidden_paths_are_masked(tmp_path):
    secret = os.path.join(os.path.dirname(os.__file__), "textwrap.py")
    with Sandbox.from_files({}, backend="bwrap", hidden_paths=(secret,)) as box:
        result = box.run(f"wc -c < {secret}")
    assert result.output.strip() == "0"


def test_killed_at_cpu_limit(sandbox):
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=30)
    result = sandbox.run("python3 -c 'while True: pass'", limits=limits)
    assert result.killed_reason == "cpu" and result.wall_seconds < limits.wall_seconds


def test_killed_at_wall_limit(sandbox):
    result = sandbox.run("sleep 30")
    assert result.killed_reason == "wall" and result.wall_seconds < FAST.wall_seconds + 2


def test_memory_limit(sandbox):
    result = sandbox.run("python3 -c 'x = bytearray(2 << 30); print(len(x))'")
    assert result.returncode != 0 and "MemoryError" in result.output


def test_infinite_output_is_cut(sandbox):
    result = sandbox.run("yes")
    assert result.killed_reason == "output"
    assert len(result.output) <= FAST.output_bytes


def test_fork_bomb_is_contained(sandbox):
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    (sandbox.workspace / "cj_bomb_probe.py").write_text(bomb)
    result = sandbox.run("python3 cj_bomb_probe.py")
    assert result.killed_reason in ("wall", "cpu")
    survivors = subprocess.run(["pgrep", "-f", "cj_bomb_probe"], capture_output=True, text=True)
    assert survivors.stdout.strip() == ""
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork


def test_fork_and_snapshot(sandbox):
    child = sandbox.fork()
    try:
        child.run("echo changed > a.txt")
        assert (sandbox.workspace / "a.txt").read_text() == "hello"
        snap = child.snapshot()
        child.run("rm a.txt")
        child.restore(snap)
        assert (child.workspace / "a.txt").read_text() == "changed\n"
    finally:
        child.close()


def test_fallback_warns_clearly(caplog, monkeypatch):
    monkeypatch.setattr(sandbox_module, "_warned_fallback", False)
    with caplog.at_level(logging.WARNING):
        Sandbox.from_files({}, backend="rlimit").close()
    assert any("NO filesystem or network isolation" in m for m in caplog.messages)
