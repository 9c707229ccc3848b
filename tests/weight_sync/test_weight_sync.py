"""Delta weight sync: bitwise-exact rebuilds over snapshots and chains, stores, corruption, async."""

import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.weight_sync import (
    CorruptShardError,
    LocalDirStore,
    MissingVersionError,
    Store,
    TensorStoreKvStore,
    WeightPublisher,
    WeightSubscriber,
    WeightSyncError,
    open_store,
)


def _params(rng):
    return {
        "embed": rng.normal(0, 0.02, (64, 32)).astype(np.float32),
        "layers": [
            {"w": rng.normal(0, 0.05, (32, 48)).astype(np.float32), "norm": np.ones(32, np.float32)}
            for _ in range(2)
        ],
        "bias": np.zeros(7, np.float32),
    }


def _step(params, rng, lr=1e-3):
    """An AdamW-like update: every weight moves by about lr."""
    return jax.tree.map(
        lambda x: x - lr * np.sign(rng.normal(size=x.shape)).astype(x.dtype), params
    )


def _words(tree):
    """The trainer's bf16 cast as uint16 words, keyed by tree path."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(p): np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).view(np.uint16)
        for p, x in leaves
    }


def _assert_bitwise(sub, params):
    got = {k: v.view(np.uint16) for k, v in sub.arrays().items()}
    want = _words(params)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _store(kind, tmp_path):
    if kind == "local":
        return LocalDirStore(str(tmp_path / "sync"))
    if kind == "ts_file":
        return open_store(f"file://{tmp_path}/ts/")
    return TensorStoreKvStore("memory://")


@pytest.mark.parametrize("mode", ["xor", "add"])
@pytest.mark.parametrize("store_kind", ["local", "ts_file", "ts_memory"])
def test_rebuild_bitwise_through_snapshots_and_deltas(mode, store_kind, tmp_path):
    rng = np.random.default_rng(0)
    store = _store(store_kind, tmp_path)
    params = _params(rng)
    follower = WeightSubscriber(store)
    kinds = []
    with WeightPublisher(store, delta=mode, snapshot_every=3) as pub:
        for version in range(8):
            info = pub.publish(params, version)
            kinds.append(info.kind)
            assert follower.update() == version
            _assert_bitwise(follower, params)
            last = params
            params = _step(params, rng)
    assert kinds == ["snapshot", "delta", "delta"] * 2 + ["snapshot", "delta"]
    fresh = WeightSubscriber(store)  # catching up from scratch: snapshot 6 + delta 7
    assert fresh.version is None and fresh.update() == 7
    _assert_bitwise(fresh, last)
    assert fresh.available_versions() == list(range(8))


def test_catch_up_several_versions_and_go_back(tmp_path):
    rng = np.random.default_rng(1)
    store = LocalDirStore(str(tmp_path))
    history = [_params(rng)]
    for _ in range(9):
        history.append(_step(history[-1], rng))
    sub = WeightSubscriber(store)
    with WeightPublisher(store, snapshot_every=4) as pub:
        pub.publish(history[0], 0)
        assert sub.update() == 0
        for v in range(1, 3):
            pub.publish(history[v], v)
        assert sub.update() == 2  # two deltas at once, from the held version
        _assert_bitwise(sub, history[2])
        for v in range(3, 10):
            pub.publish(history[v], v)
    assert sub.update() == 9  # across snapshots 4 and 8
    _assert_bitwise(sub, history[9])
    assert sub.update(5) == 5  # an older version: rebuilt from its own snapshot
    _assert_bitwise(sub, history[5])
    with pytest.raises(MissingVersionError, match="version 42"):
        sub.update(42)
    assert sub.version == 5


def test_sharded_params_publish_each_shard_once(tmp_path):
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rng = np.random.default_rng(2)
    host = _params(rng)
    specs = {"embed": P("a", "b"), "layers": [{"w": P(None, "a"), "norm": P()}] * 2, "bias": P()}
    params = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), host, specs, is_leaf=_is_spec
    )
    store = LocalDirStore(str(tmp_path))
    sub = WeightSubscriber(store)
    with WeightPublisher(store) as pub:
        pub.publish(params, 0)
        sub.update()
        _assert_bitwise(sub, host)
        params = jax.jit(lambda t: jax.tree.map(lambda x: x * 1.01, t))(params)
        assert pub.publish(params, 1).kind == "delta"
    sub.update()
    _assert_bitwise(sub, params)
    keys = json.loads(store.read(store.list("manifests/000000000001/")[0]))["shards"]
    assert sum(k.startswith("['embed']#") for k in keys) == 8
    assert sum(k.startswith("['layers'][0]['w']#") for k in keys) == 4
    assert sum(k.startswith("['bias']#") for k in keys) == 1  # replicated: published once
    tree = sub.tree_like(host)
    assert tree["embed"].dtype == jnp.bfloat16 and tree["embed"].shape == (64, 32)


def _is_spec(x):
    return isinstance(x, P)


def test_several_processes_version_complete_when_all_published(tmp_path):
    rng = np.random.default_rng(3)
    store = LocalDirStore(str(tmp_path))
    params = _params(rng)
    halves = [{"embed": params["embed"]}, {"layers": params["layers"], "bias": params["bias"]}]
    pubs = [WeightPublisher(store, process_index=i, process_count=2) for i in range(2)]
    sub = WeightSubscriber(store, process_count=2)
    pubs[0].publish(halves[0], 0)
    assert sub.update() is None  # process 1 has not published version 0 yet
    pubs[1].publish(halves[1], 0)
    assert sub.update() == 0
    _assert_bitwise(sub, params)
    for p in pubs:
        p.close()


def test_corrupt_or_missing_files_are_named(tmp_path):
    rng = np.random.default_rng(4)
    store = LocalDirStore(str(tmp_path))
    params = _params(rng)
    published = []
    with WeightPublisher(store, snapshot_every=10) as pub:
        for v in range(3):
            pub.publish(params, v)
            published.append(params)
            params = _step(params, rng)
    sub = WeightSubscriber(store)
    assert sub.update(1) == 1
    blob = sorted(k for k in store.list("blobs/000000000002/"))[1]
    path = os.path.join(store.root, blob)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptShardError, match=f"version 2: blob {blob}"):
        sub.update()
    assert sub.version == 1  # a failed update keeps the held weights, bit for bit
    _assert_bitwise(sub, published[1])
    os.remove(os.path.join(store.root, store.list("manifests/000000000001/")[0]))
    with pytest.raises(MissingVersionError, match="version 1 of process 0"):
        WeightSubscriber(store).update(2)  # the chain 2 -> 1 -> 0 is broken at 1


def test_a_delta_applied_to_another_base_is_refused(tmp_path):
    # Two runs' stores; version 1 of the second (its delta and blobs, each blob's own checksum
    # intact) copied over the first's: rebuilt on the first's version 0 it is neither run's
    # weights, and only the rebuilt values' checksums can tell.
    stores = []
    for name, seed in (("a", 0), ("b", 1)):
        rng = np.random.default_rng(seed)
        store = LocalDirStore(str(tmp_path / name))
        params = _params(rng)
        with WeightPublisher(store, snapshot_every=10) as pub:
            for v in range(2):
                pub.publish(params, v)
                params = _step(params, rng)
        stores.append(store)
    first, second = stores
    sub = WeightSubscriber(first)
    assert sub.update(0) == 0
    for key in second.list("manifests/000000000001/") + second.list("blobs/000000000001/"):
        target = os.path.join(first.root, key)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(os.path.join(second.root, key), "rb") as f, open(target, "wb") as out:
            out.write(f.read())
    with pytest.raises(CorruptShardError, match="does not match its checksum"):
        sub.update(1)
    assert sub.version == 0


class _SlowStore(Store):
    """Delays every write; can fail manifests to simulate a publisher dying mid-version."""

    def __init__(self, inner, delay_s=0.0):
        self.inner, self.delay_s, self.fail_manifests = inner, delay_s, False
        self.writing = threading.Event()

    def write(self, key, data):
        self.writing.set()
        time.sleep(self.delay_s)
        if self.fail_manifests and key.startswith("manifests/"):
            raise OSError("store went away")
        self.inner.write(key, data)

    def read(self, key):
        return self.inner.read(key)

    def list(self, prefix=""):
        return self.inner.list(prefix)


def test_publish_async_never_blocks_and_coalesces_exactly(tmp_path):
    rng = np.random.default_rng(5)
    slow = _SlowStore(LocalDirStore(str(tmp_path)))
    history = [_params(rng)]
    for _ in range(6):
        history.append(_step(history[-1], rng))
    with WeightPublisher(slow, max_pending=1) as pub:
        pub.publish(history[0], 0)  # compiles the cast
        slow.delay_s = 0.1  # 6 shards: ~0.6 s per version
        futures, waits = [], []
        for v in range(1, 7):
            t = time.perf_counter()
            futures.append(pub.publish_async(history[v], v))
            waits.append(time.perf_counter() - t)
            slow.writing.wait(5)
        assert max(waits) < 0.25, waits  # the trainer never waits for the store
        assert not futures[-1].done()
        infos = [f.result(timeout=30) for f in futures]
    skipped = [i.version for i in infos if i.skipped]
    assert skipped and infos[-1].kind == "delta"  # intermediate versions were coalesced
    published = [i for i in infos if not i.skipped]
    assert all(i.parent == j.version for i, j in zip(published[1:], published))
    sub = WeightSubscriber(slow)
    assert sub.update() == 6
    _assert_bitwise(sub, history[6])
    assert sub.available_versions() == [0] + [i.version for i in published]


def test_half_written_version_invisible_and_next_delta_exact(tmp_path):
    rng = np.random.default_rng(6)
    store = _SlowStore(LocalDirStore(str(tmp_path)))
    p0 = _params(rng)
    p1 = _step(p0, rng)
    p2 = _step(p1, rng)
    sub = WeightSubscriber(store)
    with WeightPublisher(store) as pub:
        pub.publish(p0, 0)
        store.fail_manifests = True
        with pytest.raises(OSError, match="store went away"):
            pub.publish(p1, 1)
        assert sub.update() == 0 and store.list("blobs/000000000001/")  # blobs, no manifest
        store.fail_manifests = False
        assert pub.publish(p2, 2).parent == 0
    assert sub.update() == 2
    _assert_bitwise(sub, p2)


def test_background_subscriber_follows_publisher(tmp_path):
    rng = np.random.default_rng(7)
    store = LocalDirStore(str(tmp_path))
    sub = WeightSubscriber(store)
    seen = []
    sub.start(lambda v, s: seen.append(v), interval_s=0.02)
    params = _params(rng)
    with WeightPublisher(store) as pub:
        for v in range(3):
            pub.publish(params, v)
            params = _step(params, rng) if v < 2 else params
            deadline = time.time() + 5
            while sub.version != v and time.time() < deadline:
                time.sleep(0.01)
    sub.stop()
    assert seen[-1] == 2 and sub.last_error is None
    _assert_bitwise(sub, params)


def test_versions_must_increase_within_and_across_runs(tmp_path):
    store = LocalDirStore(str(tmp_path))
    params = _params(np.random.default_rng(8))
    with WeightPublisher(store) as pub:
        pub.publish(params, 3)
        with pytest.raises(ValueError, match="last queued version 3"):
            pub.publish_async(params, 3)
    with WeightPublisher(store) as restarted:
        with pytest.raises(WeightSyncError, match="already holds version 3"):
            restarted.publish(params, 2)
        assert restarted.publish(params, 4).kind == "snapshot"
    assert WeightSubscriber(store).update() == 4
