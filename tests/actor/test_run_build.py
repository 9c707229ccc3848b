"""The actor loop's set-up: a step that fails once the environment workers exist takes them
down with it (and the trackers), instead of leaving worker processes behind a caller that
goes on (an experiment script, a notebook)."""

import concurrent.futures
import dataclasses
import types

import pytest

from composer_jax import presets
from composer_jax.actor import run


class _Closing:
    def __init__(self, *args, **kwargs):
        self.closed = False

    def close(self, *args):
        self.closed = True

    def write(self, *args):
        pass


class _Pool:
    def __init__(self):
        self.shut_down = False

    def shutdown(self):
        self.shut_down = True


class _Trainer:
    restored_step, version = None, 0

    def __init__(self, *args, **kwargs):
        pass

    def publish(self):
        failed = concurrent.futures.Future()
        failed.set_exception(OSError("the weight store is full"))
        return failed


def test_a_failed_first_publication_shuts_the_environment_workers_down(monkeypatch, tmp_path):
    writers, pool = [], _Pool()
    monkeypatch.setattr(run, "heldout_once", lambda *a: types.SimpleNamespace(mean=0, pass_rate=0))
    monkeypatch.setattr(run, "RLTrainer", _Trainer)
    monkeypatch.setattr(
        run, "MetricsWriter", lambda *a, **k: writers.append(_Closing()) or writers[-1]
    )
    monkeypatch.setattr(run, "make_roles", lambda *a: (object(), pool))
    monkeypatch.setattr(run, "_prompts", lambda cfg: [])
    monkeypatch.setattr(run, "_rewind", lambda *a: None)
    cfg = dataclasses.replace(presets.rl_tiny(), workdir=str(tmp_path))
    folder = types.SimpleNamespace(tokenizer=None, commit=lambda *a: {})
    with pytest.raises(OSError, match="the weight store is full"):
        run._build(cfg, folder, None, None, None, None, progress=False)
    assert pool.shut_down and writers[0].closed
