"""Where published weights live: a local folder or any tensorstore kvstore (gs://, s3://,
memory://...), behind one small `Store` interface; and the errors of the weight sync."""

from __future__ import annotations

import os
import threading

DELTA_MODES = ("xor", "add")


class WeightSyncError(RuntimeError):
    """Base class for weight-sync failures."""


class MissingVersionError(WeightSyncError):
    """A requested version, a manifest of its chain or one of its blobs is not in the store."""


class CorruptShardError(WeightSyncError):
    """A blob or a rebuilt shard does not match the checksum its manifest records."""


class Store:
    """Flat key -> bytes storage; every `write` must be atomic (readers see old or new, not half)."""

    def write(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def read(self, key: str) -> bytes:
        """The value of `key`; KeyError when absent."""
        raise NotImplementedError

    def list(self, prefix: str = "") -> list[str]:
        raise NotImplementedError


class LocalDirStore(Store):
    """A local (or NFS) directory; atomic writes by a temporary file, fsync and rename."""

    _TMP = ".tmp-"

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)

    def write(self, key: str, data: bytes) -> None:
        path = os.path.join(self.root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = os.path.join(
            os.path.dirname(path),
            f"{self._TMP}{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}",
        )
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def read(self, key: str) -> bytes:
        try:
            with open(os.path.join(self.root, key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise KeyError(key) from None

    def list(self, prefix: str = "") -> list[str]:
        keys = []  # walk only below the prefix's directory: blobs/ may hold many files
        for dirpath, _, files in os.walk(os.path.join(self.root, prefix.rpartition("/")[0])):
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            keys += [name if rel == "." else f"{rel}/{name}" for name in files]
        return sorted(k for k in keys if k.startswith(prefix) and self._TMP not in k)


class TensorStoreKvStore(Store):
    """Any tensorstore kvstore (`file://`, `memory://`, `gs://`, `s3://`, or a spec dict)."""

    def __init__(self, spec: str | dict):
        import tensorstore as ts

        self._ts = ts
        self.kv = ts.KvStore.open(spec).result()

    def write(self, key: str, data: bytes) -> None:
        self.kv.write(key, data).result()

    def read(self, key: str) -> bytes:
        result = self.kv.read(key).result()
        if result.state != "value":
            raise KeyError(key)
        return bytes(result.value)

    def list(self, prefix: str = "") -> list[str]:
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1) if prefix else ""
        keys = self.kv.list(self._ts.KvStore.KeyRange(prefix, end)).result()
        return sorted(k.decode() for k in keys)


def open_store(location: str | dict) -> Store:
    """A local directory for a plain path, a tensorstore kvstore for a URL (`scheme://`) or spec."""
    if isinstance(location, dict) or "://" in location:
        return TensorStoreKvStore(location)
    return LocalDirStore(location)
