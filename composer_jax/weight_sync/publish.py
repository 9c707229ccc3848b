"""Trainer -> inference weight sync (the publisher and the subscriber) through a store, as zstd-compressed bf16 deltas.

The trainer's publisher casts each step's parameters to bf16 (the served precision) and writes, per
addressable shard, the difference of its 16-bit words to the last *published* version: XOR
(default) or the words' difference modulo 2**16, zigzag-coded ("add": exact, and +-1 ulp steps
become 2 and 1); delta words are grouped by the exponent of their base word and coded as changed
positions plus 2-bit values (`codec.pack_delta`), snapshots as two byte planes, then zstd. Every
`snapshot_every` publications a full snapshot is written instead, bounding the chain. The
subscriber rebuilds the bf16 weights bitwise from the newest snapshot plus the chain,
and checks a CRC of every blob and of every rebuilt shard.

Store layout (keys, any store):
  blobs/<version>/<process>/<ordinal>.zst         one compressed shard
  manifests/<version>/<process>-of-<count>.json   written last: a version is complete once every
                                                  process's manifest exists
Each manifest names its parent (the version its deltas are against) so that coalesced
(skipped) versions never break a chain, and its `format` (`codec.FORMAT`): a reader refuses any
other one by name rather than misreading it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import zstandard

from composer_jax.weight_sync.codec import (
    FORMAT,
    blob_key,
    cast_bf16,
    check_float,
    crc,
    decode_words,
    encode_words,
    from_planes,
    local_shards,
    manifest_key,
    pack_delta,
    to_planes,
    unpack_delta,
)
from composer_jax.weight_sync.stores import (
    DELTA_MODES,
    CorruptShardError,
    MissingVersionError,
    Store,
    WeightSyncError,
)


@dataclasses.dataclass(frozen=True)
class PublishInfo:
    """What one publication wrote; `skipped` when a newer version superseded it in the queue."""

    version: int
    kind: str = "skipped"  # "snapshot" | "delta" | "skipped"
    parent: int | None = None
    raw_bytes: int = 0
    compressed_bytes: int = 0
    seconds: float = 0.0

    @property
    def skipped(self) -> bool:
        return self.kind == "skipped"

    @property
    def ratio(self) -> float:
        return self.compressed_bytes / max(self.raw_bytes, 1)


class WeightPublisher:
    """Trainer side: publishes bf16 params as snapshots and deltas to a store.

    `publish_async` only dispatches an on-device bf16 cast (so donated train-state buffers can be
    reused at once) and queues it; a background thread fetches, diffs, compresses and writes. At
    most `max_pending` publications wait behind the running one: when the queue is full the oldest
    waiting one is dropped (its future reports `skipped`). Deltas are always against the last
    version actually published, so dropping never breaks the subscriber's exact rebuild.
    """

    def __init__(
        self,
        store: Store,
        *,
        delta: str = "xor",
        snapshot_every: int = 8,
        level: int = 3,
        max_pending: int = 1,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        if delta not in DELTA_MODES:
            raise ValueError(f"delta must be one of {DELTA_MODES}, got {delta!r}")
        if snapshot_every < 1 or max_pending < 1:
            raise ValueError("snapshot_every and max_pending must be >= 1")
        self.store, self.delta, self.snapshot_every = store, delta, snapshot_every
        self.max_pending = max_pending
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        self._compressor = zstandard.ZstdCompressor(level=level, write_checksum=True)
        self._last: dict[str, np.ndarray] = {}  # shard key -> last published uint16 words
        self._last_version: int | None = None
        self._last_queued: int | None = None
        self._since_snapshot = 0
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._running = False
        self._thread = threading.Thread(target=self._worker, name="weight-publisher", daemon=True)
        self._thread.start()

    @property
    def last_version(self) -> int | None:
        return self._last_version

    def publish(self, params: Any, version: int) -> PublishInfo:
        """Publishes synchronously (after anything queued)."""
        return self.publish_async(params, version).result()

    def publish_async(self, params: Any, version: int) -> concurrent.futures.Future:
        """Queues `params` as `version` and returns at once with a future of its PublishInfo.

        Call it before the next train step may donate `params`: the bf16 copy is dispatched here.
        """
        if self._last_queued is not None and version <= self._last_queued:
            raise ValueError(f"version {version} <= last queued version {self._last_queued}")
        check_float(params)
        bf16 = cast_bf16(params)
        for leaf in jax.tree.leaves(bf16):
            leaf.copy_to_host_async()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                raise WeightSyncError("publisher is closed")
            if len(self._queue) >= self.max_pending:
                _, old_version, old_future = self._queue.popleft()
                old_future.set_result(PublishInfo(old_version))
            self._queue.append((bf16, version, future))
            self._last_queued = version
            self._cv.notify_all()
        return future

    def flush(self) -> None:
        """Waits until every queued publication has been written (or dropped)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._queue and not self._running)

    def close(self) -> None:
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _worker(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                bf16, version, future = self._queue.popleft()
                self._running = True
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(self._write(bf16, version))
                    except BaseException as e:  # noqa: BLE001 -- delivered through the future
                        future.set_exception(e)
            finally:
                with self._cv:
                    self._running = False
                    self._cv.notify_all()

    def _check_fresh(self, version: int) -> None:
        """A restarted trainer must not interleave its versions with a previous run's."""
        suffix = f"/{self.process_index:05d}-of-{self.process_count:05d}.json"
        held = [int(k.split("/")[1]) for k in self.store.list("manifests/") if k.endswith(suffix)]
        if held and max(held) >= version:
            raise WeightSyncError(
                f"the store already holds version {max(held)} >= {version} from an earlier run: "
                "publish newer versions or use a fresh store"
            )

    def _write(self, bf16: Any, version: int) -> PublishInfo:
        start = time.perf_counter()
        if self._last_version is None:
            self._check_fresh(version)
        shards = local_shards(bf16)
        words = {k: np.asarray(d).view(np.uint16).ravel() for k, _, _, _, d in shards}
        snapshot = (
            self._last_version is None
            or self._since_snapshot >= self.snapshot_every
            or set(words) != set(self._last)
            or any(w.shape != self._last[k].shape for k, w in words.items())
        )
        parent = None if snapshot else self._last_version
        entries, raw, compressed = {}, 0, 0
        for ordinal, (key, name, index, shape, _) in enumerate(shards):
            base = None if snapshot else self._last[key]
            stored = encode_words(words[key], base, self.delta)
            payload = to_planes(stored) if snapshot else pack_delta(stored, base)
            blob = self._compressor.compress(payload)
            blob_name = blob_key(version, self.process_index, ordinal)
            self.store.write(blob_name, blob)
            entries[key] = {
                "path": name,
                "index": index,
                "global_shape": list(shape),
                "size": int(words[key].size),
                "blob": blob_name,
                "blob_crc": zlib.crc32(blob),
                "value_crc": crc(words[key]),
            }
            raw += 2 * words[key].size
            compressed += len(blob)
        manifest = {
            "format": FORMAT,
            "version": version,
            "parent": parent,
            "kind": "snapshot" if snapshot else "delta",
            "mode": self.delta,
            "process": self.process_index,
            "process_count": self.process_count,
            "shards": entries,
        }
        key = manifest_key(version, self.process_index, self.process_count)
        self.store.write(key, json.dumps(manifest).encode())
        self._last, self._last_version = words, version
        self._since_snapshot = 1 if snapshot else self._since_snapshot + 1
        return PublishInfo(
            version, manifest["kind"], parent, raw, compressed, time.perf_counter() - start
        )


class WeightSubscriber:
    """Inference side: rebuilds the newest complete version from the store, bitwise exact.

    `update()` catches up any number of versions at once: from the chain's snapshot, or from the
    version it already holds when that is on the chain. A failed update leaves the held weights
    untouched. `start()` polls in a background thread and calls back on each new version.
    """

    def __init__(self, store: Store, *, process_count: int = 1):
        self.store, self.process_count = store, process_count
        self._decompressor = zstandard.ZstdDecompressor()
        self._state: tuple[int | None, dict[str, np.ndarray], dict[str, dict]] = (None, {}, {})
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: Exception | None = None

    @property
    def version(self) -> int | None:
        """The version held (None before the first update)."""
        return self._state[0]

    def available_versions(self) -> list[int]:
        """Versions whose manifests from every publishing process are all in the store."""
        counts: dict[int, set[str]] = collections.defaultdict(set)
        suffix = f"-of-{self.process_count:05d}.json"
        for key in self.store.list("manifests/"):
            _, version, name = key.split("/")
            if name.endswith(suffix):
                counts[int(version)].add(name)
        return sorted(v for v, names in counts.items() if len(names) == self.process_count)

    def update(self, version: int | None = None) -> int | None:
        """Rebuilds `version` (default: the newest complete one); returns the version held."""
        with self._lock:
            if version is None:
                available = self.available_versions()
                if not available:
                    return self.version
                version = available[-1]
            if version == self.version:
                return version
            held_version, held, held_meta = self._state
            shards, meta = {}, {}
            for process in range(self.process_count):
                chain = self._chain(version, process, held_version)
                base = held if chain[-1]["kind"] == "delta" else {}
                for manifest in reversed(chain):
                    base = self._apply(manifest, base)
                for key, entry in chain[0]["shards"].items():
                    if crc(base[key]) != entry["value_crc"]:
                        raise CorruptShardError(
                            f"version {version}: rebuilt shard {key} does not match its checksum"
                        )
                    shards[key], meta[key] = base[key], entry
            self._state = (version, shards, meta)
            return version

    def _manifest(self, version: int, process: int) -> dict:
        key = manifest_key(version, process, self.process_count)
        try:
            manifest = json.loads(self.store.read(key))
        except KeyError:
            raise MissingVersionError(
                f"version {version} of process {process} is not in the store ({key} missing)"
            ) from None
        except json.JSONDecodeError as e:
            raise CorruptShardError(f"manifest {key} is not valid JSON: {e}") from None
        written = manifest.get("format", 1)  # format 1 manifests carried no field
        if written != FORMAT:
            raise WeightSyncError(
                f"manifest {key} is in weight-sync format {written}; this reader decodes format "
                f"{FORMAT} only: publish to a fresh store with the reader's version"
            )
        return manifest

    def _chain(self, version: int, process: int, held: int | None) -> list[dict]:
        """Manifests from `version` back to a snapshot or to a delta whose parent is `held`."""
        chain = [self._manifest(version, process)]
        while chain[-1]["kind"] == "delta" and chain[-1]["parent"] != held:
            chain.append(self._manifest(chain[-1]["parent"], process))
        return chain

    def _apply(self, manifest: dict, base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for key, entry in manifest["shards"].items():
            try:
                blob = self.store.read(entry["blob"])
            except KeyError:
                raise MissingVersionError(
                    f"version {manifest['version']}: blob {entry['blob']} of shard {key} missing"
                ) from None
            if zlib.crc32(blob) != entry["blob_crc"]:
                raise CorruptShardError(
                    f"version {manifest['version']}: blob {entry['blob']} of shard {key} is corrupt"
                )
            snapshot = manifest["kind"] == "snapshot"
            if not snapshot and key not in base:
                raise MissingVersionError(f"version {manifest['version']}: no base for {key}")
            try:
                data = self._decompressor.decompress(blob)
                if snapshot:
                    out[key] = from_planes(data, entry["size"])
                else:
                    stored = unpack_delta(data, base[key])
                    out[key] = decode_words(stored, base[key], manifest["mode"])
            except (ValueError, zstandard.ZstdError) as e:
                raise CorruptShardError(
                    f"version {manifest['version']}: blob {entry['blob']} of shard {key}: {e}"
                ) from None
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        """The held weights as full bf16 arrays keyed by tree path (`jax.tree_util.keystr`)."""
        _, shards, meta = self._state
        out: dict[str, np.ndarray] = {}
        filled: dict[str, int] = collections.defaultdict(int)
        for key, words in shards.items():
            entry = meta[key]
            name = entry["path"]
            if name not in out:
                out[name] = np.zeros(entry["global_shape"], jnp.bfloat16)
            region = tuple(slice(a, b) for a, b in entry["index"])
            out[name][region] = words.view(jnp.bfloat16).reshape(out[name][region].shape)
            filled[name] += words.size
        for name, arr in out.items():
            if filled[name] != arr.size:
                raise WeightSyncError(f"{name}: the published shards do not cover the array")
        return out

    def tree_like(self, template: Any) -> Any:
        """The held weights in the structure of `template` (e.g. the served params pytree)."""
        arrays = self.arrays()
        leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
        missing = [
            jax.tree_util.keystr(p) for p, _ in leaves if jax.tree_util.keystr(p) not in arrays
        ]
        if missing:
            raise WeightSyncError(f"held weights lack {missing[:5]}")
        return treedef.unflatten([arrays[jax.tree_util.keystr(p)] for p, _ in leaves])

    def start(
        self, on_update: Callable[[int, WeightSubscriber], None], interval_s: float = 0.5
    ) -> None:
        """Polls the store in a background thread; calls `on_update(version, self)` on news.

        Errors (a version being written, a transient store failure) are kept in `last_error` and
        retried at the next poll.
        """
        self._stop.clear()

        def loop():
            while not self._stop.is_set():
                try:
                    before = self.version
                    after = self.update()
                    if after is not None and after != before:
                        on_update(after, self)
                    self.last_error = None
                except Exception as e:  # noqa: BLE001 -- retried at the next poll
                    self.last_error = e
                self._stop.wait(interval_s)

        self._thread = threading.Thread(target=loop, name="weight-subscriber", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
