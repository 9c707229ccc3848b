"""Runs cannot be mixed up: every start is recorded (command, commit, packages, devices, config),
a workdir is resumed only with the config it was started with (the refusal lists the differing
fields and leaves the old run's files as they were), and a finished run is extended only when
asked to."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from composer_jax.config import ConfigError
from composer_jax.train import loop, run_pretraining
from composer_jax.train.workdir import LAUNCHES, check_resume, config_diff
from tests.train.helpers import ONE_PHASE, make_corpus, tiny_experiment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus):
    """A finished 3-step run, started twice with the same config (the second start resumes it)."""
    workdir = str(tmp_path_factory.mktemp("run") / "run")
    cfg = tiny_experiment(workdir, corpus, steps=3)
    first = run_pretraining(cfg, progress=False)
    again = run_pretraining(cfg, progress=False)
    return cfg, first, again


def _snapshot(workdir: str) -> dict[str, bytes]:
    files = {}
    for root, _, names in os.walk(workdir):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, workdir)] = f.read()
    return files


def _launches(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, LAUNCHES)) as f:
        return [json.loads(line) for line in f]


def test_every_start_is_recorded_and_a_finished_run_is_not_extended(finished):
    cfg, first, again = finished
    assert first.final_step == 3 and again.final_step == 3  # the same config ran nothing more
    launches = _launches(cfg.workdir)
    assert [(r["kind"], r["resumed_step"]) for r in launches] == [
        ("pretrain", None),
        ("pretrain", 3),
    ]
    record = launches[0]
    commit = subprocess.run(
        ["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert record["git"]["commit"] == commit and isinstance(record["git"]["dirty"], bool)
    assert {"jax", "jaxlib", "flax", "optax", "numpy"} <= set(record["packages"])
    assert record["devices"]["platform"] == "cpu" and record["devices"]["count"] >= 1
    assert record["command"][0] == sys.executable
    assert record["config"]["optim"]["learning_rate"] == cfg.optim.learning_rate
    assert record["config"]["train"]["phases"][1]["seq_len"] == 64


def test_a_changed_config_stops_with_the_diff_and_touches_nothing(finished):
    cfg, _, _ = finished
    before = _snapshot(cfg.workdir)
    phases = (cfg.train.phases[0], dataclasses.replace(cfg.train.phases[1], seq_len=48))
    changed = dataclasses.replace(
        cfg,
        optim=dataclasses.replace(cfg.optim, learning_rate=cfg.optim.learning_rate * 3),
        train=dataclasses.replace(cfg.train, phases=phases),
        steps=6,
    )
    with pytest.raises(ConfigError) as error:
        run_pretraining(changed, progress=False)
    message = str(error.value)
    for field in ("optim.learning_rate", "train.phases[1].seq_len", "steps"):
        assert field in message
    assert "train.phases[0]" not in message and "model." not in message
    assert _snapshot(cfg.workdir) == before


def test_more_steps_alone_are_refused_unless_asked_for(finished, tmp_path):
    cfg, _, _ = finished
    longer = dataclasses.replace(cfg, steps=5)
    with pytest.raises(ConfigError, match="--config.resume=must"):
        check_resume(cfg.workdir, longer)
    assert check_resume(cfg.workdir, dataclasses.replace(longer, resume="must")) is True
    # Where the run lives and how verbosely it reports are free to change.
    moved = dataclasses.replace(cfg, workdir=str(tmp_path / "elsewhere"), print_sharding=True)
    assert config_diff(cfg, moved) == []


def test_must_extends_the_run_and_never_refuses_it(tmp_path, corpus):
    workdir = str(tmp_path / "run")
    cfg = tiny_experiment(workdir, corpus, steps=2, phases=ONE_PHASE)
    with pytest.raises(ConfigError, match="holds no run"):
        run_pretraining(dataclasses.replace(cfg, resume="must"), progress=False)
    assert not os.path.exists(workdir)  # a refused start leaves no empty run behind
    run_pretraining(dataclasses.replace(cfg, resume="never"), progress=False)
    with pytest.raises(ConfigError, match="already holds a run"):
        run_pretraining(dataclasses.replace(cfg, resume="never"), progress=False)
    extended = run_pretraining(dataclasses.replace(cfg, steps=3, resume="must"), progress=False)
    assert extended.final_step == 3
    assert [r["resumed_step"] for r in _launches(workdir)] == [None, 2]
    assert json.load(open(os.path.join(workdir, "config.json")))["steps"] == 3


def test_an_extended_run_reads_on_where_it_stopped(tmp_path, corpus, monkeypatch):
    """Extended past its last step, the run's phase goes on with the data it had not read (its
    iterator was dropped at the phase's end, so the extension trained on the first batches
    again); a longer run whose earlier phase would move is refused."""
    seen = []
    real = loop._make_iterator

    class Recording:  # the training iterator, each batch it gives recorded
        def __init__(self, iterator):
            self.iterator = iterator

        def __getattr__(self, name):
            return getattr(self.iterator, name)

        def __next__(self):
            batch = next(self.iterator)
            seen.append(hashlib.sha256(np.asarray(batch["tokens"]).tobytes()).hexdigest())
            return batch

    monkeypatch.setattr(loop, "_make_iterator", lambda *args: Recording(real(*args)))
    cfg = tiny_experiment(str(tmp_path / "run"), corpus, steps=2, phases=ONE_PHASE)
    run_pretraining(cfg, progress=False)
    first, seen[:] = list(seen), []
    run_pretraining(dataclasses.replace(cfg, steps=4, resume="must"), progress=False)
    assert len(first) == len(seen) == 2 and not set(first) & set(seen)

    two = tiny_experiment(str(tmp_path / "two"), corpus, steps=2)  # phases [0, 1), [1, 2)
    run_pretraining(two, progress=False)
    with pytest.raises(ConfigError, match=r"moves the phases the run trained in"):
        run_pretraining(dataclasses.replace(two, steps=4, resume="must"), progress=False)
    assert json.load(open(tmp_path / "two" / "config.json"))["steps"] == 2  # left as it was
    assert [r["resumed_step"] for r in _launches(str(tmp_path / "two"))] == [None]


def test_an_unreadable_stored_config_is_named(tmp_path, corpus):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="stored config .* cannot be read"):
        check_resume(str(workdir), tiny_experiment(str(workdir), corpus))
