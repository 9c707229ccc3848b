"""The delta codec alone: bitwise round trips on fresh random words of every kind, refusal of
malformed payloads; and through the store: corrupt payloads, old formats, bf16 / odd / empty
leaves rebuilt exactly."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.weight_sync import (
    CorruptShardError,
    LocalDirStore,
    WeightPublisher,
    WeightSubscriber,
    WeightSyncError,
    codec,
)

SIZES = [0, 1, 7, 1000, 100_003]


def _bf16_words(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).view(np.uint16).ravel()


def _pair(kind: str, size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(base, new) uint16 words of one kind of update."""
    if kind == "f32_step":  # an Adam-like step on fp32 masters, both cast to bf16
        w = rng.normal(0, 0.02, size).astype(np.float32)
        w[rng.random(size) < 0.01] = 0.0
        step = 1e-4 * np.sign(rng.normal(size=size)) * rng.lognormal(0, 1, size)
        return _bf16_words(w), _bf16_words(w - step.astype(np.float32))
    if kind == "bf16_step":  # a step taken in bf16 itself, norms near 1 included
        w = jnp.asarray(rng.normal(1.0, 0.5, size), jnp.bfloat16)
        step = jnp.asarray(rng.normal(0, 1e-2, size), jnp.bfloat16)
        return _bf16_words(w), _bf16_words(w + step)
    base = rng.integers(0, 2**16, size, dtype=np.uint16)  # every exponent, inf and NaN too
    if kind == "random":
        return base, rng.integers(0, 2**16, size, dtype=np.uint16)
    if kind == "unchanged":
        return base, base.copy()
    new = base.copy()  # "sparse": a few far-apart changes, first and last word included
    if size:
        at = np.unique(np.r_[0, size - 1, rng.choice(size, min(size, 5))])
        new[at] += rng.choice(np.array([1, 65535, 3, 40000], np.uint16), at.size)
    return base, new


@pytest.mark.parametrize("mode", ["xor", "add"])
@pytest.mark.parametrize("kind", ["f32_step", "bf16_step", "random", "unchanged", "sparse"])
@pytest.mark.parametrize("size", SIZES)
def test_delta_round_trips_bitwise(mode, kind, size):
    rng = np.random.default_rng()  # fresh inputs on every run; the seed is in the message
    seed = int(rng.integers(2**32))
    base, new = _pair(kind, size, np.random.default_rng(seed))
    stored = codec.encode_words(new, base, mode)
    payload = codec.pack_delta(stored, base)
    got = codec.decode_words(codec.unpack_delta(payload, base), base, mode)
    np.testing.assert_array_equal(got, new, err_msg=f"{mode} {kind} {size} seed {seed}")
    if kind == "unchanged":
        assert len(payload) == 16  # the header alone


@pytest.mark.parametrize("size", SIZES)
def test_snapshot_planes_round_trip_bitwise(size):
    words = np.random.default_rng().integers(0, 2**16, size, dtype=np.uint16)
    np.testing.assert_array_equal(codec.from_planes(codec.to_planes(words), size), words)


def test_zigzag_makes_one_ulp_moves_small_and_inverts_exactly():
    words = np.arange(2**16, dtype=np.uint16)
    assert np.all(codec.encode_words(words + np.uint16(1), words, "add") == 2)
    assert np.all(codec.encode_words(words - np.uint16(1), words, "add") == 1)
    np.testing.assert_array_equal(codec.unzigzag(codec.zigzag(words)), words)


def test_gap_codes_span_long_runs_of_unchanged_words():
    base = np.full(2000, 0x3F80, np.uint16)  # one exponent: 1.0
    for gaps in ([0], [254], [255], [256], [509, 510, 0, 1], [1999]):
        new = base.copy()
        new[np.cumsum(np.array(gaps) + 1) - 1] += np.uint16(1)
        payload = codec.pack_delta(codec.encode_words(new, base, "add"), base)
        got = codec.decode_words(codec.unpack_delta(payload, base), base, "add")
        np.testing.assert_array_equal(got, new, err_msg=str(gaps))


def test_dense_exponent_groups_use_the_bitmap_and_escapes_survive():
    rng = np.random.default_rng(0)
    base = _bf16_words(rng.normal(0, 1e-3, 4096).astype(np.float32))
    new = base + rng.integers(0, 600, base.size).astype(np.uint16)  # most words, many escapes
    payload = codec.pack_delta(codec.encode_words(new, base, "add"), base)
    split, ngaps = np.frombuffer(payload, "<u8", count=2)
    assert split > 0 and ngaps < base.size // 4
    np.testing.assert_array_equal(
        codec.decode_words(codec.unpack_delta(payload, base), base, "add"), new
    )


def test_small_steps_compress_well_below_the_raw_words():
    import zstandard

    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.02, 200_000).astype(np.float32)
    base, new = _bf16_words(w), _bf16_words(w - 1e-5 * np.sign(rng.normal(size=w.size)))
    stored = codec.encode_words(new, base, "add")
    blob = zstandard.compress(codec.pack_delta(stored, base))
    planes = zstandard.compress(codec.to_planes(stored))  # the words in tensor order
    assert len(blob) < 0.6 * len(planes) and len(blob) < 0.08 * 2 * w.size


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p[:10], "no header"),
        (lambda p: p[:-1], "escape bytes|value codes"),
        (lambda p: p + b"\0", "escape bytes"),
        (lambda p: np.array([10**6, 0], "<u8").tobytes() + p[16:], "does not fit"),
        (lambda p: p[:8] + np.array([10**6], "<u8").tobytes() + p[16:], "does not fit"),
        (lambda p: p[:16] + b"\xfe" * 8 + p[16:], "does not fit|run past|escape"),
    ],
)
def test_malformed_payloads_are_refused(damage, message):
    rng = np.random.default_rng(2)
    base, new = _pair("f32_step", 3000, rng)
    payload = codec.pack_delta(codec.encode_words(new, base, "add"), base)
    with pytest.raises(ValueError, match=message):
        codec.unpack_delta(damage(payload), base)


def _publish_two_versions(store, params0, params1):
    with WeightPublisher(store, delta="add") as pub:
        pub.publish(params0, 0)
        assert pub.publish(params1, 1).kind == "delta"


def _rewrite_manifest(store, version, edit):
    key = store.list(f"manifests/{version:012d}/")[0]
    manifest = json.loads(store.read(key))
    edit(manifest)
    store.write(key, json.dumps(manifest).encode())


def test_a_corrupt_payload_with_a_matching_crc_is_refused_by_name(tmp_path):
    import zlib

    import zstandard

    store = LocalDirStore(str(tmp_path))
    rng = np.random.default_rng(3)
    p0 = {"w": rng.normal(0, 0.02, (64, 33)).astype(np.float32)}
    _publish_two_versions(store, p0, {"w": p0["w"] + 1e-3})
    bad = zstandard.compress(b"\x01" * 40)  # valid zstd, not a delta of 64 x 33 words
    blob = store.list("blobs/000000000001/")[0]
    store.write(blob, bad)

    def edit(manifest):
        (entry,) = manifest["shards"].values()
        entry["blob_crc"] = zlib.crc32(bad)

    _rewrite_manifest(store, 1, edit)
    with pytest.raises(CorruptShardError, match=f"version 1: blob {blob} .*does not fit"):
        WeightSubscriber(store).update(1)


def test_an_older_format_is_refused_with_a_clear_error(tmp_path):
    store = LocalDirStore(str(tmp_path))
    p0 = {"w": np.ones((8, 8), np.float32)}
    _publish_two_versions(store, p0, {"w": p0["w"] * 1.5})
    _rewrite_manifest(store, 1, lambda m: m.pop("format"))
    with pytest.raises(WeightSyncError, match="format 1; this reader decodes format 2"):
        WeightSubscriber(store).update(1)
    assert WeightSubscriber(store).update(0) == 0


def test_bf16_odd_empty_and_unchanged_leaves_rebuild_exactly(tmp_path):
    rng = np.random.default_rng(4)
    params = {
        "bf16": jnp.asarray(rng.normal(0, 0.02, (37, 129)), jnp.bfloat16),
        "odd": rng.normal(0, 0.1, 12_345).astype(np.float32),
        "empty": np.zeros((0, 16), np.float32),
        "frozen": rng.normal(0, 1, (5, 7)).astype(np.float32),
    }
    store = LocalDirStore(str(tmp_path))
    sub = WeightSubscriber(store)
    with WeightPublisher(store, delta="add", snapshot_every=4) as pub:
        for version in range(3):
            pub.publish(params, version)
            assert sub.update() == version
            got = sub.tree_like(params)
            for name, leaf in params.items():
                np.testing.assert_array_equal(
                    np.asarray(got[name]).view(np.uint16).ravel(), _bf16_words(leaf), name
                )
            params = dict(
                params,
                bf16=params["bf16"] - jnp.asarray(1e-4, jnp.bfloat16),
                odd=params["odd"] + 1e-5 * np.sign(rng.normal(size=12_345)).astype(np.float32),
            )
    assert jax.tree.map(np.shape, sub.tree_like(params))["empty"] == (0, 16)
