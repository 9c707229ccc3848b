"""Sandbox limits and basic isolation on every backend usable here (bwrap, unshare, and the
unisolated rlimit fallback); the escape probes are in test_escapes.py."""

import logging
import os
import subprocess
import sys
import tempfile

import pytest

from composer_jax.envs.sandbox import IsolationUnavailable, Sandbox, SandboxLimits, isolation
from composer_jax.envs.sandbox import box as sandbox_module

FAST = SandboxLimits(cpu_seconds=2, wall_seconds=4, memory_bytes=512 << 20, max_processes=32)


def backend_param(name):
    usable = isolation.usable(name)
    return pytest.param(name, marks=pytest.mark.skipif(not usable, reason=f"{name} not usable"))


ISOLATING = [backend_param("bwrap"), backend_param("unshare")]
ALL = [*ISOLATING, "rlimit"]


def make_sandbox(backend, root=None, **kwargs):
    kwargs.setdefault("limits", FAST)
    return Sandbox.from_files(
        {"a.txt": "hello"}, root=root, backend=backend, require_isolation=False, **kwargs
    )


@pytest.fixture(params=ALL)
def sandbox(request, tmp_path):
    box = make_sandbox(request.param, str(tmp_path))
    yield box
    box.close()


def test_runs_in_workspace(sandbox):
    result = sandbox.run("cat a.txt && echo more > b.txt")
    assert result.ok and result.output == "hello"
    assert (sandbox.workspace / "b.txt").read_text() == "more\n"


@pytest.mark.parametrize("backend", ISOLATING)
def test_isolated_view(backend, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    with make_sandbox(backend, str(tmp_path)) as box:
        result = box.run(
            f"echo x > {outside}/f; echo y > /etc/cj_probe; echo z > /tmp/ok; cat /tmp/ok; "
            "python3 -c 'print(2 + 3)'"
        )
    assert not (outside / "f").exists() and not os.path.exists("/etc/cj_probe")
    assert "Read-only file system" in result.output or "No such file" in result.output
    assert result.output.strip().endswith("z\n5")  # private /tmp is writable, Python runs


@pytest.mark.parametrize("backend", ISOLATING)
def test_cannot_open_a_socket(backend):
    code = "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2); print('open')"
    with make_sandbox(backend) as box:
        result = box.run(f'python3 -c "{code}"')
    assert "open" not in result.output and result.returncode != 0


@pytest.mark.parametrize("backend", ISOLATING)
def test_hidden_paths_are_masked(backend):
    secret = os.path.join(os.path.dirname(os.__file__), "textwrap.py")
    masked_dir = os.path.join(os.path.dirname(os.__file__), "json")
    with make_sandbox(backend, hidden_paths=(secret, masked_dir)) as box:
        result = box.run(f"wc -c < {secret}; ls {masked_dir} | wc -l")
    assert result.output.split() == ["0", "0"]


@pytest.mark.parametrize("backend", ISOLATING)
def test_extra_binds_are_seen_read_only(backend, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "x.txt").write_text("folder ")
    single = tmp_path / "one.txt"
    single.write_text("file")
    binds = {str(folder): "/data", str(single): "/opt/cj/one.txt"}
    with make_sandbox(backend) as box:
        result = box.run(
            "cat /data/x.txt /opt/cj/one.txt; echo w > /data/y || echo refused",
            extra_ro_binds=binds,
        )
    assert result.output.startswith("folder file") and "refused" in result.output
    assert not (folder / "y").exists()


@pytest.mark.skipif(not isolation.usable("unshare"), reason="unshare not usable")
def test_unshare_reports_a_root_it_cannot_build():
    with make_sandbox("unshare") as box:
        result = box.run("echo ran", extra_ro_binds={"/nonexistent/cj": "/x"})
    assert result.returncode == 125 and "ran" not in result.output
    assert "sandbox setup failed" in result.output and "/nonexistent/cj" in result.output


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


@pytest.mark.parametrize("backend", ISOLATING)
@pytest.mark.parametrize("uid", [0, 1000])
def test_root_without_a_cgroup_is_refused_not_left_uncapped(backend, uid, monkeypatch):
    """Root is exempt from RLIMIT_NPROC, so without a pids cgroup nothing would cap a command's
    processes: an isolating sandbox refuses to start as root, a normal user gets the rlimit."""
    monkeypatch.setattr(sandbox_module.cgroups, "available", lambda: False)
    monkeypatch.setattr(sandbox_module.os, "geteuid", lambda: uid)
    if uid == 0:
        with pytest.raises(IsolationUnavailable, match="as root where no cgroup"):
            Sandbox.from_files({"a.txt": "x"}, backend=backend)
    else:
        with Sandbox.from_files({"a.txt": "x"}, backend=backend) as box:
            assert box.isolated


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


def test_fallback_warns_once(caplog, monkeypatch):
    monkeypatch.setattr(sandbox_module, "_warned", set())
    with caplog.at_level(logging.WARNING):
        Sandbox.from_files({}, backend="rlimit", require_isolation=False).close()
        Sandbox.from_files({}, backend="rlimit", require_isolation=False).close()
    warnings = [m for m in caplog.messages if "NO filesystem, process or network isolation" in m]
    assert len(warnings) == 1


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="sandbox backend"):
        Sandbox.from_files({}, backend="docker")
    with pytest.raises(IsolationUnavailable, match="does not isolate"):
        Sandbox.from_files({}, backend="rlimit")


@pytest.mark.parametrize("backend", ISOLATING)
def test_a_process_leaves_no_temporary_folders_behind_but_the_shared_etc(backend, tmp_path):
    """The host folders a backend needs for the process's life (unshare's root mount point, the
    workspace) are removed when the process exits; bwrap's made-up /etc is one folder per user
    and content, kept for the next process."""
    program = (
        "import sys\n"
        "from composer_jax.envs.sandbox import Sandbox\n"
        "with Sandbox.from_files({'a.txt': 'x'}, backend=sys.argv[1]) as box:\n"
        "    assert box.run('cat a.txt').output == 'x'\n"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path))  # the workspace goes there too (removed)
    for _ in range(2):
        subprocess.run([sys.executable, "-c", program, backend], env=env, check=True)
    left = os.listdir(tmp_path)
    if backend == "bwrap":
        assert len(left) == 1 and isolation._is_synthetic_etc(str(tmp_path / left[0]))
    else:
        assert left == []


def test_processes_killed_before_their_exit_handlers_share_one_made_up_etc(tmp_path):
    """Sandbox workers are killed, so their exit handlers never run: each such process used to
    leave its own /etc folder in /tmp."""
    program = (
        "import os\n"
        "from composer_jax.envs.sandbox import isolation\n"
        "print(isolation._synthetic_etc())\n"
        "os._exit(0)\n"
    )
    env = dict(os.environ, TMPDIR=str(tmp_path))
    folders = {
        subprocess.run(
            [sys.executable, "-c", program], env=env, check=True, capture_output=True, text=True
        ).stdout.strip()
        for _ in range(3)
    }
    assert len(folders) == 1 and os.listdir(tmp_path) == [os.path.basename(folders.pop())]


@pytest.mark.parametrize("plant", ["other_passwd", "writable_by_others", "extra_file"])
def test_a_folder_planted_at_the_shared_etc_name_is_not_bound(plant, tmp_path, monkeypatch):
    """/tmp is everyone's: a folder placed at the shared name beforehand (an account file of
    its own, one that others can change, or a file more) is never what the sandbox binds."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(isolation, "_synthetic_dir", None)
    shared = isolation._synthetic_etc()
    monkeypatch.setattr(isolation, "_synthetic_dir", None)
    if plant == "other_passwd":
        os.chmod(os.path.join(shared, "passwd"), 0o644)
        with open(os.path.join(shared, "passwd"), "a") as f:
            f.write("intruder:x:0:0::/:/bin/sh\n")
        os.chmod(os.path.join(shared, "passwd"), 0o444)
    elif plant == "writable_by_others":
        os.chmod(shared, 0o777)
    else:
        with open(os.path.join(shared, "shadow"), "w") as f:
            f.write("root::0:::::\n")
    used = isolation._synthetic_etc()
    assert used != shared and isolation._is_synthetic_etc(used)
    with open(os.path.join(used, "passwd")) as f:
        assert "intruder" not in f.read()


def test_a_file_cannot_grow_past_the_file_size_limit(sandbox):
    # 4 MiB written to the workspace (whose own cap is far above) against a 1 MiB file limit.
    limits = SandboxLimits(cpu_seconds=5, wall_seconds=10, file_bytes=1 << 20)
    result = sandbox.run(
        "python3 -c \"open('big', 'wb').write(b'0' * (4 << 20))\"; wc -c < big", limits=limits
    )
    assert int(result.output.split()[-1]) <= 1 << 20, result.output


@pytest.mark.parametrize("backend", ISOLATING)
def test_tmp_holds_at_most_its_size(backend):
    # 16 MiB into /tmp against a 4 MiB /tmp (each file may be far larger): the write fails
    # with no space left, and /tmp never holds more than its size.
    limits = SandboxLimits(cpu_seconds=5, wall_seconds=10, tmp_bytes=4 << 20, file_bytes=64 << 20)
    with make_sandbox(backend, limits=limits) as box:
        result = box.run(
            "python3 -c \"open('/tmp/big', 'wb').write(b'0' * (16 << 20))\"; wc -c < /tmp/big"
        )
    assert "No space left" in result.output, result.output
    assert int(result.output.split()[-1]) <= 4 << 20, result.output
