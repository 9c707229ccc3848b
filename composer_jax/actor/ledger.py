"""Durable ledger of finished RL groups: a restarted job resumes without re-running rollouts and
trains every group exactly once.

Every record is one file made visible by an atomic rename (written to a temporary name, fsynced,
renamed, directory fsynced), so a crash at any point leaves each record either complete or absent;
in a bucket (`gs://`) each record is one object, which the store writes whole (`durable`):
  groups/<group id>.npz              a finished group: its arrays plus a JSON metadata member
  consumed/trained-<step>.json       the groups trainer step <step> consumed
  consumed/dropped-<n>.json          groups dropped (too stale, or uninformative), with the reason
Leftover temporary files are removed when the ledger is opened. Pure numpy: no JAX, so it can
live with the environments on CPU-only hosts.

Exactly-once with the trainer's checkpoints: call `mark_trained(ids, step)` when step `step` has
been applied; after restoring checkpoint step s, call `rewind(s)` so groups consumed by steps that
the restored model never saw become pending again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import zipfile
from typing import Any

import numpy as np

from composer_jax.actor import durable

log = logging.getLogger(__name__)

_META = "__meta__"
_ID = re.compile(r"^[A-Za-z0-9_.-]+$")


class LedgerError(RuntimeError):
    """An operation would break exactly-once accounting (unknown, duplicate or reused group)."""


class DamagedGroup(LedgerError):
    """A group file that cannot be read back; it has been set aside (`.corrupt`) and counted."""


@dataclasses.dataclass
class Group:
    """A finished group of samples of one prompt, ready to train on.

    `policy_versions` holds the policy version of every generated token (any shape); a group is as
    stale as its oldest token. `arrays` holds the rest of the training data (tokens, masks,
    sampler log-probs...), nested dicts allowed; `metadata` must be JSON-serialisable.
    """

    group_id: str
    prompt_id: str
    policy_versions: np.ndarray
    advantages: np.ndarray
    rewards: np.ndarray
    arrays: dict[str, Any] = dataclasses.field(default_factory=dict)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def min_version(self) -> int:
        return int(np.min(self.policy_versions))


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    flat = {}
    for key, value in tree.items():
        if "/" in key:
            raise LedgerError(f"array name {key!r} must not contain '/'")
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = np.asarray(value)
    return flat


def _unflatten(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


def _read_record(path: str, name: str) -> dict | None:
    """A consumed/ record, or None when it is torn, garbled or not the expected shape."""
    try:
        with durable.open_binary(path) as f:
            record = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("group_ids"), list):
        return None
    if name.startswith("trained-") and not isinstance(record.get("step"), int):
        return None
    if name.startswith("dropped-") and not isinstance(record.get("current_version"), int):
        return None
    return record


class GroupLedger:
    """Finished groups on disk with who consumed them; reopening gives the last consistent view."""

    def __init__(self, directory: str):
        self.directory = durable.absolute(directory)
        self._groups_dir = os.path.join(self.directory, "groups")
        self._consumed_dir = os.path.join(self.directory, "consumed")
        durable.make_dirs(self._groups_dir)
        durable.make_dirs(self._consumed_dir)
        self._lock = threading.Lock()
        self._index: dict[str, dict] = {}  # group id -> metadata (versions summary, add order)
        self._trained: dict[str, int] = {}  # group id -> trainer step
        self._steps: dict[int, list[str]] = {}
        self._dropped: dict[str, int] = {}  # group id -> version it was dropped at
        self._drop_reason: dict[str, str] = {}
        self._drop_records = 0
        self.corrupt: list[str] = []  # group files that could not be read (moved aside)
        self.corrupt_records: list[str] = []  # consumed/ records that could not be read
        self._load()

    # ------------------------------------------------------------------------------ reopening
    def _load(self) -> None:
        for d in (self._groups_dir, self._consumed_dir):
            for name in durable.list_names(d):
                if name.startswith(durable.TMP_PREFIX):  # a write that never completed
                    durable.remove(os.path.join(d, name))
        for name in sorted(durable.list_names(self._groups_dir)):
            if name.endswith(".npz.corrupt"):  # set aside by an earlier start
                self.corrupt.append(name[: -len(".npz.corrupt")])
            if not name.endswith(".npz"):
                continue
            path = os.path.join(self._groups_dir, name)
            try:
                with durable.open_binary(path) as f, np.load(f, allow_pickle=False) as z:
                    meta = json.loads(z[_META].tobytes())  # the metadata member only
            except (zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError):
                durable.move(path, path + ".corrupt")
                self.corrupt.append(name[: -len(".npz")])
                continue
            self._index[meta["group_id"]] = meta
        for name in sorted(durable.list_names(self._consumed_dir)):
            if name.startswith("dropped-"):  # the next record's number (set-aside ones too)
                number = name.removeprefix("dropped-").split(".")[0]
                if number.isdigit():
                    self._drop_records = max(self._drop_records, int(number) + 1)
            if name.endswith(".corrupt"):
                self.corrupt_records.append(name.removesuffix(".corrupt"))
                continue
            path = os.path.join(self._consumed_dir, name)
            record = _read_record(path, name)
            if record is None:
                # Its groups read as pending again: a damaged "trained" record can lead to a
                # group trained twice, a damaged "dropped" one to a stale group trained.
                durable.move(path, path + ".corrupt")
                self.corrupt_records.append(name)
                log.warning(
                    "ledger record %s is damaged; set aside as %s.corrupt (the groups it listed "
                    "count as pending again)",
                    path,
                    path,
                )
                continue
            if name.startswith("trained-"):
                self._steps[record["step"]] = record["group_ids"]
                for gid in record["group_ids"]:
                    self._trained[gid] = record["step"]
            elif name.startswith("dropped-"):
                for gid in record["group_ids"]:
                    self._dropped[gid] = record["current_version"]
                    self._drop_reason[gid] = record.get("reason", "stale")

    # -------------------------------------------------------------------------------- writing
    def add(self, group: Group) -> None:
        """Persists a finished group; visible (and pending) once this returns."""
        if not _ID.match(group.group_id):
            raise LedgerError(f"group id {group.group_id!r} must match {_ID.pattern}")
        arrays = _flatten(group.arrays)
        for reserved in ("policy_versions", "advantages", "rewards", _META):
            if reserved in arrays:
                raise LedgerError(f"array name {reserved!r} is reserved")
        meta = {
            "group_id": group.group_id,
            "prompt_id": group.prompt_id,
            "min_version": group.min_version,
            "max_version": int(np.max(group.policy_versions)),
            "metadata": group.metadata,
        }
        arrays.update(
            policy_versions=np.asarray(group.policy_versions),
            advantages=np.asarray(group.advantages),
            rewards=np.asarray(group.rewards),
        )
        with self._lock:
            if group.group_id in self._index:
                raise LedgerError(f"group {group.group_id} is already in the ledger")
            meta["order"] = len(self._index)
            payload = json.dumps(meta).encode()
            arrays[_META] = np.frombuffer(payload, np.uint8)
            path = os.path.join(self._groups_dir, f"{group.group_id}.npz")
            durable.write_atomically(path, lambda f: np.savez(f, **arrays))
            self._index[group.group_id] = meta

    def mark_trained(self, group_ids: list[str], step: int) -> None:
        """Records, atomically, that trainer step `step` consumed `group_ids`.

        Repeating the same call (e.g. after a crash) is a no-op; consuming a group twice, an
        unknown or a dropped group, or reusing a step for other groups raises LedgerError.
        """
        group_ids = list(group_ids)
        with self._lock:
            if step in self._steps:
                if sorted(self._steps[step]) == sorted(group_ids):
                    return
                raise LedgerError(f"step {step} is already recorded with other groups")
            if len(set(group_ids)) != len(group_ids):
                raise LedgerError(f"step {step}: a group is listed twice")
            for gid in group_ids:
                if gid not in self._index:
                    raise LedgerError(f"step {step}: unknown group {gid}")
                if gid in self._trained:
                    raise LedgerError(
                        f"group {gid} was already trained at step {self._trained[gid]}"
                    )
                if gid in self._dropped:
                    raise LedgerError(f"group {gid} was dropped as stale")
            record = json.dumps({"step": step, "group_ids": group_ids}).encode()
            path = os.path.join(self._consumed_dir, f"trained-{step:012d}.json")
            durable.write_atomically(path, lambda f: f.write(record))
            self._steps[step] = group_ids
            self._trained.update(dict.fromkeys(group_ids, step))

    def rewind(self, step: int) -> list[str]:
        """After restoring checkpoint `step`: groups consumed by later steps become pending again.

        Idempotent, so a crash in the middle is repaired by calling it again. Returns their ids.
        """
        with self._lock:
            returned = []
            for later in sorted(s for s in self._steps if s > step):
                durable.remove(os.path.join(self._consumed_dir, f"trained-{later:012d}.json"))
                for gid in self._steps.pop(later):
                    del self._trained[gid]
                    returned.append(gid)
            durable.sync_dir(self._consumed_dir)
            return returned

    def drop_stale(
        self, current_version: int, max_staleness: int, drop_newer: bool = False
    ) -> list[str]:
        """Drops (for good) pending groups whose oldest token lags more than `max_staleness`;
        with `drop_newer`, also those with tokens newer than `current_version` (after a restart:
        sampled by weights the restored trainer never had)."""
        with self._lock:
            stale = [
                gid
                for gid in self._pending_ids()
                if current_version - self._index[gid]["min_version"] > max_staleness
                or (drop_newer and self._index[gid]["max_version"] > current_version)
            ]
            self._write_drop(stale, current_version, "stale", max_staleness=max_staleness)
            return stale

    def drop(self, group_ids: list[str], current_version: int, reason: str) -> None:
        """Drops (for good) pending groups for another `reason` (e.g. "uninformative": every
        sample of the group got the same task reward)."""
        with self._lock:
            for gid in group_ids:
                if gid not in self._index or gid in self._trained or gid in self._dropped:
                    raise LedgerError(f"group {gid} is not pending")
            self._write_drop(list(group_ids), current_version, reason)

    def _write_drop(self, group_ids: list[str], current_version: int, reason: str, **extra):
        if not group_ids:
            return
        record = {
            "current_version": current_version,
            "reason": reason,
            "group_ids": group_ids,
            **extra,
        }
        data = json.dumps(record).encode()
        path = os.path.join(self._consumed_dir, f"dropped-{self._drop_records:06d}.json")
        durable.write_atomically(path, lambda f: f.write(data))
        self._drop_records += 1
        self._dropped.update(dict.fromkeys(group_ids, current_version))
        self._drop_reason.update(dict.fromkeys(group_ids, reason))

    # -------------------------------------------------------------------------------- reading
    def _pending_ids(self) -> list[str]:
        ids = [g for g in self._index if g not in self._trained and g not in self._dropped]
        return sorted(ids, key=lambda g: self._index[g]["order"])

    def pending(self) -> list[str]:
        """Ids of groups neither trained nor dropped, in the order they were added."""
        with self._lock:
            return self._pending_ids()

    def dropped(self, reason: str | None = None) -> list[str]:
        """Ids of every group dropped (this run or an earlier one), for `reason` if given."""
        with self._lock:
            return sorted(g for g in self._dropped if reason in (None, self._drop_reason[g]))

    def __iter__(self):
        """Ids of every group ever added, in order."""
        with self._lock:
            return iter(sorted(self._index, key=lambda g: self._index[g]["order"]))

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._index

    def trained_step(self, group_id: str) -> int | None:
        return self._trained.get(group_id)

    def staleness(self, group_id: str, current_version: int) -> int:
        """How many versions the group's oldest token lags `current_version`."""
        return current_version - self._index[group_id]["min_version"]

    def load(self, group_id: str) -> Group:
        """The full group. A file that cannot be read back (zip CRCs catch a flipped byte) is
        set aside as `.corrupt`, counted, and the group leaves the ledger: DamagedGroup."""
        path = os.path.join(self._groups_dir, f"{group_id}.npz")
        try:
            with durable.open_binary(path) as f, np.load(f, allow_pickle=False) as z:
                flat = {name: z[name] for name in z.files}
            meta = json.loads(flat.pop(_META).tobytes())
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError) as e:
            with self._lock:
                if durable.exists(path):
                    durable.move(path, path + ".corrupt")
                self._index.pop(group_id, None)
                self.corrupt.append(group_id)
            raise DamagedGroup(
                f"group {group_id}: {path} is damaged ({type(e).__name__}: {e}); set aside"
            ) from None
        return Group(
            group_id=meta["group_id"],
            prompt_id=meta["prompt_id"],
            policy_versions=flat.pop("policy_versions"),
            advantages=flat.pop("advantages"),
            rewards=flat.pop("rewards"),
            arrays=_unflatten(flat),
            metadata=meta["metadata"],
        )

    def stats(self) -> dict[str, int]:
        """Counts for metrics: groups added, trained, dropped (as stale, for another reason),
        pending, corrupt."""
        with self._lock:
            return {
                "added": len(self._index),
                "trained": len(self._trained),
                "dropped_stale": sum(r == "stale" for r in self._drop_reason.values()),
                "dropped_other": sum(r != "stale" for r in self._drop_reason.values()),
                "pending": len(self._pending_ids()),
                "corrupt": len(self.corrupt),
                "corrupt_records": len(self.corrupt_records),
            }
