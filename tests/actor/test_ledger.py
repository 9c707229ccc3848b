"""Group ledger: exactly-once training across crashes, kill -9 of a writer, staleness accounting."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from composer_jax.actor import ledger as ledger_module
from composer_jax.actor.ledger import DamagedGroup, Group, GroupLedger, LedgerError

# Shared by the tests and the killed writer subprocess: group i's content is a function of i.
_MAKE_GROUP = """
def make_group(Group, i, n=4, tokens=16):
    rng = np.random.default_rng(i)
    rewards = rng.normal(size=n).astype(np.float32)
    return Group(
        group_id=f"g{i:05d}",
        prompt_id=f"p{i // 2}",
        policy_versions=np.full((n, tokens), i // 3, np.int32),
        advantages=rewards - rewards.mean(),
        rewards=rewards,
        arrays={"tokens": rng.integers(0, 259, (n, tokens)), "extra": {"mask": np.ones(n, bool)}},
        metadata={"turns": [1, 2, 3], "index": i},
    )
"""
_scope = {"np": np}
exec(_MAKE_GROUP, _scope)
make_group = _scope["make_group"]

_WRITER = f"""
import importlib.util, sys
import numpy as np
spec = importlib.util.spec_from_file_location("ledger", {ledger_module.__file__!r})
mod = sys.modules["ledger"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
{_MAKE_GROUP}
led = mod.GroupLedger(sys.argv[1])
i = int(sys.argv[2])
while True:
    g = make_group(mod.Group, i)
    g.arrays["big"] = np.full(2_000_000, i, np.float32)  # a write takes a while: kills land in it
    led.add(g)
    print(g.group_id, flush=True)
    i += 1
"""


def _assert_same(a: Group, b: Group):
    assert (a.group_id, a.prompt_id, a.metadata) == (b.group_id, b.prompt_id, b.metadata)
    for name in ("policy_versions", "advantages", "rewards"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    np.testing.assert_array_equal(a.arrays["tokens"], b.arrays["tokens"])
    np.testing.assert_array_equal(a.arrays["extra"]["mask"], b.arrays["extra"]["mask"])


def test_round_trip_and_reopen(tmp_path):
    led = GroupLedger(str(tmp_path))
    groups = [make_group(Group, i) for i in range(3)]
    for g in groups:
        led.add(g)
    assert led.pending() == ["g00000", "g00001", "g00002"]
    _assert_same(led.load("g00001"), groups[1])
    led.mark_trained(["g00000", "g00002"], step=0)
    again = GroupLedger(str(tmp_path))
    assert again.pending() == ["g00001"] and again.trained_step("g00002") == 0
    _assert_same(again.load("g00002"), groups[2])
    assert again.stats() == {
        "added": 3,
        "trained": 2,
        "dropped_stale": 0,
        "dropped_other": 0,
        "pending": 1,
        "corrupt": 0,
        "corrupt_records": 0,
    }
    with pytest.raises(LedgerError, match="already in the ledger"):
        again.add(groups[0])
    with pytest.raises(LedgerError, match="must match"):
        again.add(Group("a/b", "p", np.zeros(1), np.zeros(1), np.zeros(1)))


def test_exactly_once_across_crashes_between_add_and_mark(tmp_path):
    led = GroupLedger(str(tmp_path))
    for i in range(6):
        led.add(make_group(Group, i))
    led.mark_trained(["g00000", "g00001"], step=1)
    # Crash after step 2 ran but before its mark: its record is a half-written temporary file.
    consumed = tmp_path / "consumed"
    (consumed / ".tmp-trained-000000000002.json.999.1").write_bytes(b'{"step": 2, "group_')
    led = GroupLedger(str(tmp_path))  # the restarted job
    assert not [n for n in os.listdir(consumed) if n.startswith(".tmp-")]
    assert led.pending() == ["g00002", "g00003", "g00004", "g00005"]
    led.mark_trained(["g00000", "g00001"], step=1)  # replaying a recorded step is a no-op
    with pytest.raises(LedgerError, match="already trained at step 1"):
        led.mark_trained(["g00001", "g00002"], step=2)
    with pytest.raises(LedgerError, match="already recorded"):
        led.mark_trained(["g00002"], step=1)
    with pytest.raises(LedgerError, match="unknown group"):
        led.mark_trained(["nope"], step=2)
    led.mark_trained(["g00002", "g00003"], step=2)
    led.mark_trained(["g00004"], step=3)
    # Crash before checkpoint 3 was saved: restore checkpoint 2, step 3's groups come back.
    led = GroupLedger(str(tmp_path))
    assert led.rewind(2) == ["g00004"] and led.rewind(2) == []
    led = GroupLedger(str(tmp_path))
    assert led.pending() == ["g00004", "g00005"]
    led.mark_trained(["g00004", "g00005"], step=3)
    led = GroupLedger(str(tmp_path))
    steps = [led.trained_step(f"g{i:05d}") for i in range(6)]
    assert steps == [1, 1, 2, 2, 3, 3] and led.pending() == []


def test_half_written_and_corrupt_group_files(tmp_path):
    led = GroupLedger(str(tmp_path))
    led.add(make_group(Group, 0))
    led.add(make_group(Group, 1))
    groups = tmp_path / "groups"
    good = (groups / "g00001.npz").read_bytes()
    (groups / ".tmp-g00002.npz.123.4").write_bytes(good[: len(good) // 2])  # killed mid-write
    (groups / "g00001.npz").write_bytes(good[: len(good) // 2])  # damaged on disk
    led = GroupLedger(str(tmp_path))
    assert led.pending() == ["g00000"] and led.corrupt == ["g00001"]
    assert sorted(os.listdir(groups)) == ["g00000.npz", "g00001.npz.corrupt"]
    assert led.stats()["corrupt"] == 1
    data = bytearray((groups / "g00000.npz").read_bytes())
    data[200] ^= 0xFF  # a flipped bit inside an array: caught by the zip CRC on load
    (groups / "g00000.npz").write_bytes(bytes(data))
    led = GroupLedger(str(tmp_path))
    assert led.pending() == ["g00000"]  # opening reads only the metadata member
    with pytest.raises(DamagedGroup, match="g00000"):
        led.load("g00000")
    assert led.pending() == [] and led.stats()["corrupt"] == 2
    assert (groups / "g00000.npz.corrupt").exists()
    assert GroupLedger(str(tmp_path)).pending() == []  # and so it stays on every restart


@pytest.mark.parametrize(
    "damage",
    [b"", b'{"step": 1, "group_ids": ["g0000', b"\x00\xff garbage", b'["not", "a", "record"]'],
)
def test_damaged_consumed_records_are_set_aside(tmp_path, damage):
    led = GroupLedger(str(tmp_path))
    for i in range(4):
        led.add(make_group(Group, i))
    led.mark_trained(["g00000"], step=1)
    led.mark_trained(["g00001"], step=2)
    led.drop(["g00002"], current_version=2, reason="uninformative")
    consumed = tmp_path / "consumed"
    (consumed / f"trained-{2:012d}.json").write_bytes(damage)
    led = GroupLedger(str(tmp_path))
    assert led.corrupt_records == [f"trained-{2:012d}.json"]
    assert led.stats()["corrupt_records"] == 1
    assert led.trained_step("g00000") == 1 and led.trained_step("g00001") is None
    assert led.pending() == ["g00001", "g00003"]
    (consumed / "dropped-000000.json").write_bytes(damage)
    led = GroupLedger(str(tmp_path))
    assert led.stats()["corrupt_records"] == 2  # counted across restarts
    led.drop(["g00003"], current_version=3, reason="uninformative")
    # The next record does not reuse the damaged one's number.
    assert sorted(p.name for p in consumed.iterdir()) == [
        "dropped-000000.json.corrupt",
        "dropped-000001.json",
        f"trained-{1:012d}.json",
        f"trained-{2:012d}.json.corrupt",
    ]


def _run_writer_and_kill(directory, start, min_groups):
    """Starts the writer, waits for `min_groups` groups, kills -9 it while a write is open."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, directory, str(start)],
        stdout=subprocess.PIPE,
        text=True,
    )
    printed = [proc.stdout.readline().strip() for _ in range(min_groups)]
    assert all(printed), "the writer died before writing its groups"
    groups = os.path.join(directory, "groups")
    deadline = time.time() + 10
    while not any(n.startswith(".tmp-") for n in os.listdir(groups)) and time.time() < deadline:
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    printed += [line.strip() for line in proc.stdout.read().splitlines()]
    proc.stdout.close()
    return printed


def test_kill_9_of_writer_keeps_every_completed_group_once(tmp_path):
    directory = str(tmp_path)
    acknowledged: list[str] = []
    half_written_seen = 0
    for _ in range(3):
        start = len(GroupLedger(directory).pending())
        acknowledged += _run_writer_and_kill(directory, start, min_groups=3)
        names = os.listdir(os.path.join(directory, "groups"))
        half_written_seen += any(n.startswith(".tmp-") for n in names)
        led = GroupLedger(directory)  # reopening cleans up the half-written file
        present = led.pending()
        assert len(present) == len(set(present))
        # Every acknowledged group is there; at most one more landed just before the kill.
        assert present[: len(acknowledged)] == acknowledged
        assert len(present) - len(acknowledged) <= 1
        acknowledged = present
        assert not [n for n in os.listdir(os.path.join(directory, "groups")) if ".tmp-" in n]
    assert half_written_seen >= 1
    for gid in acknowledged:
        i = int(gid[1:])
        g = led.load(gid)
        _assert_same(g, make_group(Group, i))
        assert np.all(g.arrays["big"] == i)
    led.mark_trained(acknowledged, step=0)
    assert GroupLedger(directory).pending() == []


def test_staleness_accounting(tmp_path):
    led = GroupLedger(str(tmp_path))
    for i in range(9):  # policy versions 0, 0, 0, 1, 1, 1, 2, 2, 2
        led.add(make_group(Group, i))
    led.mark_trained(["g00000"], step=0)
    assert led.staleness("g00003", current_version=4) == 3
    assert led.drop_stale(current_version=3, max_staleness=2) == ["g00001", "g00002"]
    assert led.drop_stale(current_version=3, max_staleness=2) == []  # counted once
    led = GroupLedger(str(tmp_path))
    assert led.drop_stale(current_version=4, max_staleness=2) == ["g00003", "g00004", "g00005"]
    assert led.pending() == ["g00006", "g00007", "g00008"]
    with pytest.raises(LedgerError, match="dropped as stale"):
        led.mark_trained(["g00004"], step=1)
    assert GroupLedger(str(tmp_path)).stats() == {
        "added": 9,
        "trained": 1,
        "dropped_stale": 5,
        "dropped_other": 0,
        "pending": 3,
        "corrupt": 0,
        "corrupt_records": 0,
    }


def test_drop_newer_and_drop_for_a_reason(tmp_path):
    led = GroupLedger(str(tmp_path))
    for i in range(4):
        led.add(make_group(Group, i))
    newest = max(led.pending(), key=lambda g: led.load(g).policy_versions.max())
    top = int(led.load(newest).policy_versions.max())
    # After restoring version top - 1, the group with a token of version `top` is dropped.
    dropped = led.drop_stale(current_version=top - 1, max_staleness=100, drop_newer=True)
    assert newest in dropped
    assert all(led.load(g).policy_versions.max() > top - 1 for g in dropped)
    rest = led.pending()
    led.drop(rest[:1], current_version=top - 1, reason="uninformative")
    with pytest.raises(LedgerError, match="not pending"):
        led.drop(rest[:1], current_version=top - 1, reason="uninformative")
    reopened = GroupLedger(str(tmp_path))
    assert reopened.dropped("uninformative") == rest[:1]
    assert sorted(reopened.dropped("stale")) == sorted(dropped)
    assert reopened.stats()["dropped_other"] == 1
    assert reopened.stats()["dropped_stale"] == len(dropped)
