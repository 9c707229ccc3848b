"""Trackers get what metrics.jsonl gets: a 3-step pretraining run logging to an offline W&B run and
a local MLflow store, then its resume continuing both; the command line names them; trackers that
cannot start are one-line errors at start-up."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from composer_jax import config as config_lib
from composer_jax.train import read_metrics, run_pretraining
from composer_jax.train.trackers import (
    TRACKERS,
    TRACKERS_FILE,
    Tracker,
    register_tracker,
    start_trackers,
)
from tests.train.helpers import ONE_PHASE, make_corpus, tiny_experiment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pretrain(workdir, steps: int, corpus: str, **overrides):
    cfg = tiny_experiment(
        str(workdir), corpus, steps=steps, log_every=1, eval_every=2, phases=ONE_PHASE
    )
    log = config_lib.LogConfig(trackers=("wandb", "mlflow"))
    return run_pretraining(dataclasses.replace(cfg, log=log, **overrides), progress=False)


def _wandb_records(path):
    """The protobuf records of a W&B transaction log (`run-<id>.wandb`): a 7-byte file header,
    then LevelDB-log chunks (crc, length, type; FULL or FIRST/MIDDLE/LAST pieces) in 32 KiB
    blocks. Read here because wandb's own reader is no longer Python."""
    data, pos, pending = pathlib.Path(path).read_bytes(), 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield chunk
        elif kind in (2, 3):
            pending = (pending if kind == 3 else b"") + chunk
        elif kind == 4:
            yield pending + chunk


def _wandb_history(workdir, run_id: str) -> dict[tuple[int, str], float]:
    """(step, key) -> value of every history row the offline W&B run(s) of `run_id` recorded."""
    from wandb.proto import wandb_internal_pb2

    rows = {}
    for log in sorted(pathlib.Path(workdir, "wandb").glob(f"offline-run-*-{run_id}/*.wandb")):
        for data in _wandb_records(log):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") != "history":
                continue
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            step = int(items.pop("_step"))
            rows.update({(step, k): v for k, v in items.items() if not k.startswith("_")})
    return rows


def _mlflow_history(workdir, run_id: str, keys) -> dict[tuple[int, str], float]:
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=os.path.join(workdir, "mlruns"))
    return {(m.step, key): m.value for key in keys for m in client.get_metric_history(run_id, key)}


def _expected(workdir) -> dict[tuple[int, str], float]:
    return {
        (m["step"], k): float(v)
        for m in read_metrics(os.path.join(workdir, "metrics.jsonl"))
        for k, v in m.items()
        if k != "step"
    }


def test_the_command_line_names_trackers(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "launch.pretrain", "--print_config",
         "--config.log.trackers=wandb,mlflow", "--config.log.mlflow_uri=sqlite:///x.db"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    log = json.loads(result.stdout)["log"]
    assert log["trackers"] == ["wandb", "mlflow"] and log["mlflow_uri"] == "sqlite:///x.db"


def test_a_pretraining_run_and_its_resume_log_to_wandb_and_mlflow(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    corpus = make_corpus(str(tmp_path / "corpus"))
    workdir = tmp_path / "run"
    assert _pretrain(workdir, 3, corpus).final_step == 3
    ids = json.loads((workdir / TRACKERS_FILE).read_text())
    want = _expected(workdir)
    assert {step for step, _ in want} == {0, 1, 2, 3}
    assert _wandb_history(workdir, ids["wandb"]) == pytest.approx(want)
    keys = {k for _, k in want}
    assert _mlflow_history(workdir, ids["mlflow"], keys) == pytest.approx(want)

    assert _pretrain(workdir, 5, corpus, resume="must").final_step == 5
    assert json.loads((workdir / TRACKERS_FILE).read_text()) == ids  # the same tracker runs
    want = _expected(workdir)
    assert {step for step, _ in want} == {0, 1, 2, 3, 4, 5}
    assert _wandb_history(workdir, ids["wandb"]) == pytest.approx(want)
    assert _mlflow_history(workdir, ids["mlflow"], keys) == pytest.approx(want)

    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=str(workdir / "mlruns")).get_run(ids["mlflow"])
    # Parameters are the first start's (MLflow keeps them immutable); metrics continue.
    assert run.data.params["steps"] == "3" and run.data.params["launch.kind"] == "pretrain"
    assert "launch.git" in run.data.params and run.info.status == "FINISHED"


class _Unavailable(Tracker):
    def __init__(self, log, workdir, params, run_id):
        import composer_jax_missing_tracker_package  # noqa: F401


class _Recording(Tracker):
    started, closed = [], []

    def __init__(self, log, workdir, params, run_id):
        super().__init__(log, workdir, params, run_id)
        self.run_id = run_id or "r1"
        self.started.append(self.run_id)

    def log(self, step, scalars):
        pass

    def close(self):
        self.closed.append(self.run_id)


def test_trackers_that_cannot_start_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setitem(TRACKERS, "unavailable", _Unavailable)
    register_tracker("recording", _Recording)
    monkeypatch.setitem(TRACKERS, "recording", _Recording)
    cases = {
        ("nope",): "log.trackers: unknown tracker 'nope'; registered: ",
        ("recording", "nope"): "log.trackers: unknown tracker 'nope'; registered: ",
        ("recording", "unavailable"): "log.trackers: unavailable needs the tracking extra",
        ("mlflow",): "log.trackers: mlflow could not start",
    }
    for trackers, message in cases.items():
        log = config_lib.LogConfig(trackers=trackers, mlflow_uri="bogus-scheme://x")
        with pytest.raises(config_lib.ConfigError) as error:
            start_trackers(log, str(tmp_path), {}, resume=False)
        assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert _Recording.closed == _Recording.started == ["r1"]  # none left open; names first
    assert not (tmp_path / TRACKERS_FILE).exists()


def test_a_config_naming_a_tracker_twice_is_refused():
    cfg = config_lib.ExperimentConfig(log=config_lib.LogConfig(trackers=("wandb", "wandb")))
    with pytest.raises(config_lib.ConfigError, match="log.trackers"):
        config_lib.validate(cfg)


def test_runs_logged_to_mlflow_compare_like_their_workdirs(tmp_path, monkeypatch):
    """Two seeds logged to one MLflow store read back through `launch.compare`'s reader give the
    table the workdirs give: same groups, same final values over seeds."""
    from composer_jax.eval import compare

    corpus = make_corpus(str(tmp_path / "corpus"))
    store = tmp_path / "mlruns"
    log = config_lib.LogConfig(trackers=("mlflow",), mlflow_uri=str(store))
    for seed in (0, 1):
        cfg = tiny_experiment(
            str(tmp_path / f"seed{seed}"), corpus, steps=2, eval_every=2, phases=ONE_PHASE
        )
        run_pretraining(dataclasses.replace(cfg, seed=seed, log=log), progress=False)
    from_mlflow = compare.compare_runs(
        [f"mlflow:{store}#composer-jax"], metrics=["loss", "eval_nll"]
    )
    from_dirs = compare.compare_runs(
        [str(tmp_path / "seed0"), str(tmp_path / "seed1")], metrics=["loss", "eval_nll"]
    )
    (first, _) = compare.load_mlflow_runs(f"mlflow:{store}#composer-jax")
    stored = json.loads((tmp_path / "seed0" / "config.json").read_text())
    assert config_lib.field_paths(first.config) == config_lib.field_paths(stored)  # every field
    assert len(from_mlflow.rows) == 1 and from_mlflow.rows[0]["seeds"] == [0, 1]
    assert from_mlflow.rows[0]["label"] == from_dirs.rows[0]["label"]  # grouped alike
    for metric in ("loss", "eval_nll"):
        assert from_mlflow.rows[0][metric] == pytest.approx(from_dirs.rows[0][metric])
