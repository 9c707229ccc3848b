"""Escape and robustness probes: model-written commands and turns trying to reach the host, outlive
their command, exceed their caps, or crash the environment. Each probe runs on every backend it
applies to that is usable here: the isolation probes on bwrap and unshare, the limit probes on
the rlimit fallback too."""

import os
import random
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from composer_jax import envs
from composer_jax.actor.env_workers import ProcessEnvironmentPool
from composer_jax.envs.grading import protocol
from composer_jax.envs.sandbox import (
    IsolationUnavailable,
    Sandbox,
    SandboxLimits,
    cgroups,
    isolation,
)
from composer_jax.envs.sandbox import box as sandbox_module
from composer_jax.envs.tools import ToolBox

REPO = Path(__file__).resolve().parents[3]
LIMITS = SandboxLimits(cpu_seconds=5, wall_seconds=10, memory_bytes=512 << 20, max_processes=32)
needs_cgroups = pytest.mark.skipif(not cgroups.available(), reason="no cgroup can be made here")


def backend_param(name):
    usable = isolation.usable(name)
    return pytest.param(name, marks=pytest.mark.skipif(not usable, reason=f"{name} not usable"))


ISOLATING = [backend_param("bwrap"), backend_param("unshare")]
ALL = [*ISOLATING, "rlimit"]


def sandbox(backend, files=None, **limits):
    return Sandbox.from_files(
        files or {"a.txt": "hello"},
        backend=backend,
        require_isolation=False,
        limits=SandboxLimits(**{**vars(LIMITS), **limits}),
    )


def alive(marker: str) -> list[str]:
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return found.stdout.split()


# ------------------------------------------------------------------ 1. isolation is required


def test_isolation_is_required_by_default(monkeypatch):
    assert envs.EnvConfig().require_isolation
    with pytest.raises(IsolationUnavailable, match="does not isolate"):
        Sandbox.from_files({}, backend="rlimit")
    monkeypatch.setattr(isolation, "usable", lambda backend: backend == "rlimit")
    with pytest.raises(IsolationUnavailable, match="install bubblewrap"):
        Sandbox.from_files({})
    with pytest.raises(IsolationUnavailable, match="not usable"):
        Sandbox.from_files({}, backend="bwrap")
    with Sandbox.from_files({}, require_isolation=False) as box:  # the explicit opt-out
        assert box.backend == "rlimit"


def test_rl_config_passes_the_requirement_to_every_environment():
    from composer_jax import config as config_lib
    from composer_jax import presets

    assert presets.rl_tiny().rl.agent.require_sandbox
    assert config_lib.RLConfig().agent.require_sandbox


@pytest.mark.parametrize("backend", ISOLATING)
def test_writes_reach_only_the_workspace(backend):
    home = Path(os.path.expanduser("~"))
    targets = [Path(tempfile.gettempdir()), home, REPO]
    names = [t / f"cj_escape_{os.getpid()}_{i}" for i, t in enumerate(targets)]
    with sandbox(backend) as box:
        result = box.run("; ".join(f"echo x > {n}" for n in names) + "; echo inside > w")
        assert (box.workspace / "w").read_text() == "inside\n"
    leaked = [n for n in names if n.exists()]
    for n in leaked:
        n.unlink()
    assert not leaked, result.output


@pytest.mark.parametrize("backend", ISOLATING)
def test_host_secrets_and_configuration_are_not_visible(backend):
    with sandbox(backend) as box:
        result = box.run(
            "cat /etc/shadow; cat /etc/hostname; ls /etc; ls /root /home 2>&1; cat /etc/passwd"
        )
    assert "root:*:" not in result.output and "root:$" not in result.output
    assert "shadow" not in result.output.split("No such file")[-1]
    listing = result.output
    assert "hostname\n" not in listing and "No such file" in listing


@pytest.mark.parametrize("backend", ISOLATING)
def test_parent_environment_is_not_readable(backend, monkeypatch):
    monkeypatch.setenv("CJ_PROBE_SECRET", "s3cr3t-value")
    with sandbox(backend) as box:
        result = box.run(
            "env; cat /proc/$PPID/environ; cat /proc/1/environ; "
            "for f in /proc/[0-9]*/environ; do cat $f; done 2>/dev/null; echo done"
        )
    assert "s3cr3t-value" not in result.output and "done" in result.output


@pytest.mark.parametrize("backend", ISOLATING)
def test_host_sockets_are_unreachable(backend, tmp_path):
    tcp = socket.create_server(("127.0.0.1", 0))
    tcp.settimeout(0.5)
    unix_path = str(tmp_path / "host.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen()
    unix.settimeout(0.5)
    port = tcp.getsockname()[1]
    code = (
        (
            "import socket\n"
            "for family, addr in ((socket.AF_INET, ('127.0.0.1', PORT)), (socket.AF_UNIX, PATH)):\n"
            "    try:\n"
            "        socket.socket(family).connect(addr); print('connected')\n"
            "    except OSError as e:\n"
            "        print('refused', type(e).__name__)\n"
        )
        .replace("PORT", str(port))
        .replace("PATH", repr(unix_path))
    )
    try:
        with sandbox(backend, {"probe.py": code}) as box:
            result = box.run("python3 probe.py")
        assert "connected" not in result.output and result.output.count("refused") == 2
        for server in (tcp, unix):
            with pytest.raises(OSError):  # nobody knocked
                server.accept()
    finally:
        tcp.close()
        unix.close()


# --------------------------------------------------------- 2. processes die with the command


@pytest.mark.parametrize("backend", ISOLATING + [pytest.param("rlimit", marks=needs_cgroups)])
def test_no_process_outlives_its_command(backend):
    marker = f"31{os.getpid() % 1000:03d}"
    command = (
        f"for i in $(seq 20); do setsid sleep {marker} & done; nohup sleep {marker} "
        f">/dev/null 2>&1 & (sleep {marker} &); echo started"
    )
    with sandbox(backend, wall_seconds=3) as box:
        result = box.run(command)
    assert "started" in result.output
    deadline = time.monotonic() + 5
    while alive(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(f"sleep {marker}")


@needs_cgroups
@pytest.mark.parametrize("backend", ISOLATING)
def test_commands_cannot_leave_their_cgroup_and_are_capped(backend):
    code = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(100):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        break\n"
        "    if pid == 0:\n"
        "        time.sleep(3); os._exit(0)\n"
        "    n += 1\n"
        "print('forked', n)\n"
    )
    with sandbox(backend, {"fork.py": code}, max_processes=16) as box:
        result = box.run(
            "echo $$ > /sys/fs/cgroup/pids/cgroup.procs; echo $$ > /sys/fs/cgroup/cgroup.procs; "
            "python3 fork.py"
        )
    forked = int(result.output.split("forked")[-1].split()[0])
    assert forked < 16, result.output


@needs_cgroups
def test_cgroups_are_removed_even_when_a_command_fails_to_start(monkeypatch):
    def ours():
        return {
            p.name
            for parent in cgroups._layout().parents
            for p in parent.glob(f"composer_jax_{os.getpid()}_*")
        }

    before = ours()
    with sandbox("auto" if isolation.usable("bwrap") else "rlimit") as box:
        for _ in range(3):
            box.run("true")

        def refuse(*args, **kwargs):
            raise OSError("no such program")

        monkeypatch.setattr(sandbox_module.subprocess, "Popen", refuse)
        assert box.run("true").returncode == 127
    assert ours() == before


# --------------------------------------------------- 3. limits per command and per episode


@needs_cgroups
@pytest.mark.parametrize("backend", ALL)
def test_memory_is_capped_for_the_whole_command(backend):
    # Three processes of 150 MB against 256 MB: each passes a per-process limit, not the sum.
    code = (
        "import time\nb = bytearray(150 << 20)\nb[::4096] = b'x' * len(b[::4096])\n"
        "time.sleep(1.5)\nprint('alive')\n"
    )
    with sandbox(backend, {"eat.py": code}, memory_bytes=256 << 20) as box:
        result = box.run("python3 eat.py & python3 eat.py & python3 eat.py & wait")
    assert result.output.count("alive") <= 1
    assert result.killed_reason == "memory"


@pytest.mark.parametrize("backend", ALL)
def test_workspace_size_and_file_count_are_capped(backend):
    with sandbox(backend, workspace_bytes=8 << 20, workspace_files=100) as box:
        fast = box.run("head -c 100000000 /dev/zero > big; sleep 2")
        assert fast.killed_reason == "workspace" and "big" in fast.output
        assert box.usage()[0] <= 8 << 20
        many = box.run("mkdir d; for i in $(seq 300); do : > d/$i; done")
        assert many.killed_reason == "workspace" and box.usage()[1] <= 100
        spread = box.run("for i in 1 2 3; do head -c 3000000 /dev/zero > f$i; done")
        assert spread.killed_reason == "workspace" and box.usage()[0] <= 8 << 20
        assert (box.workspace / "a.txt").read_text() == "hello"  # the task's files stay
        assert sum(map(len, box.snapshot().values())) <= 8 << 20


def test_tool_writes_respect_the_workspace_cap():
    with sandbox("auto", workspace_bytes=1 << 20) as box:
        tools = ToolBox(box, ("write_file", "edit_file"))
        assert tools.call("write_file", {"path": "a", "content": "x" * (600 << 10) + "END"})[1].ok
        text, record = tools.call("write_file", {"path": "b", "content": "y" * (600 << 10)})
        assert not record.ok and "limit" in text
        text, record = tools.call(
            "edit_file", {"path": "a", "old": "END", "new": "z" * (500 << 10)}
        )
        assert not record.ok and "limit" in text
        assert box.usage()[0] <= 1 << 20


def test_snapshots_are_bounded(tmp_path):
    with sandbox("auto", workspace_bytes=1 << 20) as box:
        (box.workspace / "huge").write_bytes(b"x" * (2 << 20))  # behind the sandbox's back
        with pytest.raises(envs.WorkspaceLimitError):
            box.snapshot()


# ------------------------------------------------------------- 4. the host is never a target


@pytest.mark.parametrize("backend", ISOLATING)
def test_the_host_process_cannot_be_signalled(backend):
    received = []
    previous = signal.signal(signal.SIGTERM, lambda *a: received.append("TERM"))
    try:
        config = envs.EnvConfig(backend=backend, max_turns=1)
        with envs.Episode(envs.make_task(3), config) as episode:
            command = (
                "kill -TERM $PPID; kill -STOP $PPID; kill -TERM 1; "
                f"kill -STOP {os.getpid()}; kill -TERM {os.getpid()}; kill -9 -1; echo after"
            )
            episode.step(protocol.render_turn(calls=(("run_shell", {"command": command}),)))
        assert not received
    finally:
        signal.signal(signal.SIGTERM, previous)
    state = Path(f"/proc/{os.getpid()}/stat").read_text().split(")")[-1].split()[0]
    assert state != "T"


def test_worker_timeout_covers_the_slowest_legitimate_turn():
    """Four commands each stopped at their own wall limit, then grading: one step, no worker
    lost, because the pool's timeout comes from the environment's limits."""
    limits = SandboxLimits(cpu_seconds=2, wall_seconds=1.0)
    config = envs.EnvConfig(limits=limits, max_calls_per_turn=4, max_turns=1)
    slow = tuple(("run_shell", {"command": "sleep 30"}) for _ in range(4))
    with ProcessEnvironmentPool(num_workers=1, timeout_s=config.step_seconds()) as pool:
        assert pool.start("e", envs.make_task(5), config).result(timeout=60)
        result = pool.step("e", protocol.render_turn(calls=slow, final="done")).result(timeout=120)
        assert result.done and result.observation.count("killed: wall") == 4
        assert pool.health()["worker_timeouts"] == 0


def test_a_too_short_worker_timeout_is_refused():
    from composer_jax import config as config_lib
    from composer_jax.actor.setup import env_timeout as _env_timeout

    rl = config_lib.RLConfig(rollout=config_lib.RolloutConfig(env_timeout_s=60.0))
    with pytest.raises(config_lib.ConfigError, match="rl.rollout.env_timeout_s"):
        _env_timeout(rl, envs.EnvConfig())
    assert _env_timeout(config_lib.RLConfig(), envs.EnvConfig()) == envs.EnvConfig().step_seconds()


@pytest.mark.parametrize("backend", ALL)
def test_commands_die_with_their_worker(backend):
    if backend == "rlimit" and not cgroups.available():
        pytest.skip("without namespaces or cgroups a killed worker's commands are not found")
    marker = f"32{os.getpid() % 1000:03d}"
    limits = SandboxLimits(cpu_seconds=100, wall_seconds=100.0)
    config = envs.EnvConfig(limits=limits, backend=backend, require_isolation=False)
    command = f"setsid sleep {marker} & sleep {marker}"
    with ProcessEnvironmentPool(num_workers=1, timeout_s=config.step_seconds()) as pool:
        assert pool.start("e", envs.make_task(5), config).result(timeout=60)
        step = pool.step("e", protocol.render_turn(calls=(("run_shell", {"command": command}),)))
        deadline = time.monotonic() + 20
        while len(alive(f"sleep {marker}")) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(alive(f"sleep {marker}")) >= 2
        os.kill(next(iter(pool.worker_pids().values())), signal.SIGKILL)
        with pytest.raises(Exception):
            step.result(timeout=30)
    deadline = time.monotonic() + 10
    while alive(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(f"sleep {marker}")


# ------------------------------------------------------ 5. the bwrap found is the bwrap run


@pytest.mark.skipif(not isolation.usable("bwrap"), reason="bwrap not usable")
def test_bwrap_outside_the_sandbox_path_is_the_one_run(tmp_path, monkeypatch):
    real = isolation.executable("bwrap")
    tools = tmp_path / "tools"
    tools.mkdir()
    used = tmp_path / "used"
    wrapper = tools / "bwrap"
    wrapper.write_text(f'#!/bin/sh\necho used >> {used}\nexec {real} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    for cached in (isolation.executable, isolation.usable):
        cached.cache_clear()
    try:
        with Sandbox.from_files({"a.txt": "hi"}, backend="bwrap") as box:
            result = box.run("cat a.txt")
        assert result.ok and result.output == "hi" and used.exists()
    finally:
        for cached in (isolation.executable, isolation.usable):
            cached.cache_clear()


# ------------------------------------------------------------ 6. no crash from model output


def _write(path, content, final=True):
    return protocol.render_turn(
        calls=(("write_file", {"path": path, "content": content}),), final="done" if final else None
    )


PATHOLOGICAL_TURNS = {
    "deeply nested path": _write("a/" * 1500 + "x.py", "x", final=False),
    "long path": _write("x" * 10000, "x", final=False),
    "unary chain": _write("solution.py", "x = " + "-" * 100000 + "1\n"),
    "attribute chain": _write("solution.py", "x = a" + ".a" * 100000 + "\n"),
    "nested brackets": _write("solution.py", "x = " + "[" * 5000 + "]" * 5000 + "\n"),
    "nested calls": _write("solution.py", "x = " + "f(" * 50000 + ")" * 50000 + "\n"),
    "undecodable bytes": _write("solution.py", "x = '\udcff\udcfe'\n"),
}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL_TURNS))
def test_pathological_turns_never_crash_the_episode(name):
    with envs.Episode(envs.make_task(1), envs.EnvConfig(max_turns=2)) as episode:
        result = episode.step(PATHOLOGICAL_TURNS[name])
    assert isinstance(result.observation, str)


_TAGS = (
    "<call",
    "</call>",
    "<arg",
    "</arg>",
    "<think>",
    "</think>",
    "<final>",
    "</final>",
    'tool="',
    'name="',
    ">",
    '"',
    "\n",
    "<output",
    "CJ_RESULT",
)
_TOOLS = (*envs.TOOL_SPECS, "nope", "", "write_file\n")
_COMMAND_TOOLS = ("run_shell", "grep", "run_tests")  # slow (a process each): drawn less often
_TOOL_WEIGHTS = tuple(1 if tool in _COMMAND_TOOLS else 6 for tool in _TOOLS)


def _random_text(rng: random.Random, size: int) -> str:
    kind = rng.random()
    if kind < 0.3:
        return "".join(chr(rng.randrange(0, 0x110000)) for _ in range(size))
    if kind < 0.6:
        return "".join(rng.choice(_TAGS) for _ in range(size))
    if kind < 0.8:
        depth = rng.randint(1, 3000)
        opener, closer = rng.choice((("(", ")"), ("[", "]"), ("-", ""), (".a", ""), ("{", "}")))
        return "x = a" + opener * depth + "1" + closer * depth
    return bytes(rng.randrange(256) for _ in range(size)).decode("latin-1")


def _random_turn(rng: random.Random) -> str:
    if rng.random() < 0.2:
        return _random_text(rng, rng.randint(0, 400))
    calls = []
    for _ in range(rng.randint(0, 3)):
        tool = rng.choices(_TOOLS, _TOOL_WEIGHTS)[0]
        spec = envs.TOOL_SPECS.get(tool)
        names = list(spec.params) if spec else ["path", "x"]
        if rng.random() < 0.3:
            names.append(_random_text(rng, 5))
        args = {}
        for name in names:
            if rng.random() < 0.15:
                continue  # a missing argument
            size = rng.choice((0, 3, 40, 2000, 200000))
            value = _random_text(rng, min(size, 3000)) * max(1, size // 3000)
            if name in ("start", "end") and rng.random() < 0.5:
                value = str(rng.randint(-(10**12), 10**12))
            if name == "path" and rng.random() < 0.5:
                value = rng.choice(
                    (
                        "solution.py",
                        "test_visible.py",
                        "a/" * 40 + "b",
                        "../x",
                        "/workspace/solution.py",
                        ".",
                    )
                )
            if name == "command" and rng.random() < 0.9:
                value = rng.choice(("true", "echo hi", "ls", "cat solution.py", "exit 3"))
            args[name] = value.replace("</arg>", "")
        calls.append(
            f'<call tool="{tool}">'
            + "".join(f'<arg name="{n}">{v}</arg>' for n, v in args.items())
            + "</call>"
        )
    noise = _random_text(rng, rng.randint(0, 50)) if rng.random() < 0.5 else ""
    final = "<final>done</final>" if rng.random() < 0.05 else ""
    return noise + "".join(calls) + final


def _fuzz(num_turns: int, seed: int) -> None:
    """Plays `num_turns` generated turns in episodes of 1-30 turns; a crash names its seed."""
    rng = random.Random(seed)
    config = envs.EnvConfig(max_turns=1000, limits=SandboxLimits(cpu_seconds=2, wall_seconds=5))
    task = envs.make_task(seed)
    turns_done = 0
    while turns_done < num_turns:
        with envs.Episode(task, config) as episode:
            for _ in range(rng.randint(1, 30)):
                turn = _random_turn(rng)
                try:
                    result = episode.step(turn)
                except Exception as error:
                    raise AssertionError(
                        f"fuzz seed {seed}, turn {turns_done}: {turn!r:.300}"
                    ) from error
                turns_done += 1
                assert isinstance(result.observation, str)
                if result.done:
                    break


def test_fuzzed_turns_never_crash_the_episode():
    _fuzz(200, seed=random.randrange(1 << 30))  # 10,000 in the slow tier


@pytest.mark.slow
@pytest.mark.timeout(1500)  # 50 times the default tier's twin (about 10 s there)
def test_fuzzed_turns_never_crash_the_episode_at_length():
    _fuzz(10_000, seed=random.randrange(1 << 30))
