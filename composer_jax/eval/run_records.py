"""Runs read back for comparison: a run folder (`config.json`, `metrics.jsonl`, and for RL
`heldout.json`: {"before": {"per_task": [...], "pass_rate": p, "metrics": {...}},
"after-<step>": {...}}) or a run an MLflow tracker logged (`mlflow:URI#EXPERIMENT`: its
parameters as the config, its metric histories, its heldout.json artifact), as `RunRecord`s.
Plain json and numpy: no JAX, no training stack.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import numpy as np

from composer_jax.eval.passk import heldout_metric_order, paired_by_task


@dataclasses.dataclass
class RunRecord:
    workdir: str
    config: dict
    metrics: list[dict]
    heldout: dict | None

    @property
    def seed(self) -> int:
        return self.config.get("seed", 0)

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.workdir))

    def after_key(self) -> str | None:
        """The latest held-out evaluation after RL."""
        keys = [k for k in (self.heldout or {}) if k.startswith("after-")]
        return max(keys, key=lambda k: int(k.split("-")[1])) if keys else None

    def per_task(self, which: str, metric: str = "reward") -> np.ndarray | None:
        """A held-out metric per task ("reward", or one the evaluator recorded: "pass@1",
        "best_of_8", "turns", ...), "before" or "after" RL."""
        key = "before" if which == "before" else self.after_key()
        if not self.heldout or key not in self.heldout:
            return None
        record = self.heldout[key]
        values = record["per_task"] if metric == "reward" else record.get("metrics", {}).get(metric)
        return None if values is None else np.asarray(values, np.float64)

    def task_ids(self, which: str) -> list[str]:
        """The task of each `per_task(which)` entry ([] for a record kept before the ids were)."""
        key = "before" if which == "before" else self.after_key()
        return list(((self.heldout or {}).get(key) or {}).get("task_ids", []))

    def paired(self, which: str, other: RunRecord, other_which: str, metric: str = "reward"):
        """(this run's, `other`'s) held-out `metric` on the tasks both hold (`paired_by_task`);
        None when either has no such record."""
        mine, theirs = self.per_task(which, metric), other.per_task(other_which, metric)
        if mine is None or theirs is None:
            return None
        return paired_by_task(self.task_ids(which), mine, other.task_ids(other_which), theirs)

    def heldout_metrics(self) -> list[str]:
        """The metrics both held-out records carry, reward first."""
        before, after = (
            (self.heldout or {}).get("before"),
            (self.heldout or {}).get(self.after_key()),
        )
        if not before or not after:
            return []
        shared = set(before.get("metrics", {})) & set(after.get("metrics", {}))
        return ["reward", *sorted(shared, key=heldout_metric_order)]


def find_runs(paths: list[str]) -> list[str]:
    """Run folders among `paths`: a folder with config.json is a run, any other folder is searched
    one level down (a sweep's root)."""
    found = []
    for path in paths:
        if os.path.isfile(os.path.join(path, "config.json")):
            found.append(path)
            continue
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path}: no such folder")
        inside = sorted(
            os.path.join(path, d)
            for d in os.listdir(path)
            if os.path.isfile(os.path.join(path, d, "config.json"))
        )
        if not inside:
            raise FileNotFoundError(f"{path}: neither a run (config.json) nor a folder of runs")
        found += inside
    return found


def read_records(path: str) -> list[dict]:
    """The `{"step": ...}` records of a metrics.jsonl (none if it is missing); a torn or garbled
    line is skipped, as `train.read_metrics` does, without importing the training stack."""
    if not os.path.isfile(path):
        return []
    records = []
    with open(path, "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


def _param_value(text: str):
    """A parameter as `train.trackers.run_params` wrote it: Python's bool / None spellings, JSON
    for numbers and lists, else the string itself."""
    spelled = {"True": True, "False": False, "None": None}
    if text in spelled:
        return spelled[text]
    try:
        return json.loads(text)
    except ValueError:
        return text


def _nested(flat: dict) -> dict | list:
    """`{"train.phases.0.seq_len": 64}` -> `{"train": {"phases": [{"seq_len": 64}]}}`: the config
    tree whose field paths are the workdir config's (numbered levels become lists)."""
    root: dict = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value

    def lists(node):
        if not isinstance(node, dict):
            return node
        node = {k: lists(v) for k, v in node.items()}
        if node and all(k.isdigit() for k in node):
            return [node[str(i)] for i in range(len(node))]
        return node

    return lists(root)


def load_mlflow_runs(spec: str) -> list[RunRecord]:
    """Every run of an MLflow experiment, `mlflow:URI#EXPERIMENT` (URI a tracking server, a
    database or a folder store such as `<workdir>/mlruns`; EXPERIMENT by default composer-jax),
    oldest first. Needs the `tracking` extra."""
    from mlflow.tracking import MlflowClient

    uri, _, name = spec.removeprefix("mlflow:").partition("#")
    if "://" not in uri or uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # as the tracker writes it
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(name or "composer-jax")
    if experiment is None:
        raise FileNotFoundError(f"{spec}: no MLflow experiment {name or 'composer-jax'!r}")
    runs = []
    order = ["attributes.start_time ASC"]
    for run in client.search_runs([experiment.experiment_id], order_by=order):
        run_id, params = run.info.run_id, run.data.params
        config = _nested(
            {k: _param_value(v) for k, v in params.items() if not k.startswith("launch.")}
        )
        by_step: dict[int, dict] = {}
        for key in run.data.metrics:
            for m in client.get_metric_history(run_id, key):
                by_step.setdefault(m.step, {"step": m.step})[key] = m.value
        heldout = None
        if "heldout.json" in {a.path for a in client.list_artifacts(run_id)}:
            with tempfile.TemporaryDirectory() as local:
                with open(client.download_artifacts(run_id, "heldout.json", local)) as f:
                    heldout = json.load(f)
        metrics = [by_step[step] for step in sorted(by_step)]
        runs.append(RunRecord(run.info.run_name or run_id, config, metrics, heldout))
    return runs


def read_runs(paths: list[str]) -> list[RunRecord]:
    """The runs of `paths`: run folders, sweep roots (`find_runs`) or `mlflow:URI#EXPERIMENT`."""
    runs = []
    for path in paths:
        if path.startswith("mlflow:"):
            runs += load_mlflow_runs(path)
        else:
            runs += [load_run(p) for p in find_runs([path])]
    return runs


def load_run(workdir: str) -> RunRecord:
    with open(os.path.join(workdir, "config.json")) as f:
        config = json.load(f)
    heldout_path = os.path.join(workdir, "heldout.json")
    heldout = None
    if os.path.isfile(heldout_path):
        with open(heldout_path) as f:
            heldout = json.load(f)
    return RunRecord(workdir, config, read_records(os.path.join(workdir, "metrics.jsonl")), heldout)
