"""In-flight records: a damaged one is reported by name (its groups start over), never a crash."""

import pickle

import pytest

from composer_jax.actor.inflight import GroupState, InFlightError, InFlightStore


def test_round_trip_and_damaged_records(tmp_path):
    store = InFlightStore(str(tmp_path), keep=2)
    groups = [GroupState("p00001-g", 3, [])]
    store.save(3, groups)
    assert store.load(3) == groups and store.load(2) == []
    good = open(store.path(3), "rb").read()
    damages = {
        "truncated": good[: len(good) // 2],
        "garbage": b"\x00\xffnot a pickle",
        "empty": b"",
        "wrong format": pickle.dumps({"format": 99, "step": 3, "groups": []}),
        "wrong step": pickle.dumps({"format": 1, "step": 4, "groups": []}),
        "not a dict": pickle.dumps([1, 2, 3]),
    }
    for what, data in damages.items():
        with open(store.path(3), "wb") as f:
            f.write(data)
        with pytest.raises(InFlightError, match=str(store.path(3))):
            store.load(3)
