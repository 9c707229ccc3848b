"""Experiment trackers: where a run's metrics go besides `metrics.jsonl`.

`MetricsWriter` hands every record it writes to each tracker of `log.trackers` with the same step,
and each file a run wants kept (the RL curves and held-out table) as an artifact. A tracker's run
id is kept in `<workdir>/trackers.json`, so a resumed run continues the same tracker run. A
tracker that cannot start (its package missing, a bad URI) stops the run at start-up with one
line. New tracker: subclass `Tracker`, then `register_tracker("name", cls)` or name it
`my_pkg.trackers:MyTracker` (WORKSPACE.md, "Plug-in points").
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Mapping

from etils import epath

from composer_jax import config as config_lib
from composer_jax import plugins
from composer_jax.train.workdir import first_line, is_remote

TRACKERS_FILE = "trackers.json"


class Tracker:
    """One tracker's run. `run_id` is None for a new run, else the id to continue."""

    def __init__(self, log: config_lib.LogConfig, workdir: str, params: dict, run_id: str | None):
        self.run_id = run_id

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        raise NotImplementedError

    def artifact(self, path: str) -> None:
        """Keeps the file at `path` with the run (nothing for trackers without files)."""

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    """Scalars in `<workdir>/tensorboard`; local workdirs only (a bucket run says so once and
    keeps every scalar in metrics.jsonl)."""

    def __init__(self, log, workdir, params, run_id):
        super().__init__(log, workdir, params, run_id)
        from tensorboardX import SummaryWriter

        self._writer = None
        if is_remote(workdir):
            logging.getLogger(__name__).warning(
                "TensorBoard is written for local workdirs only; %s/metrics.jsonl has every scalar",
                workdir,
            )
        else:
            self._writer = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def log(self, step, scalars):
        for key, value in scalars.items() if self._writer is not None else ():
            self._writer.add_scalar(key, value, step)

    def close(self):
        if self._writer is not None:
            self._writer.close()


class WandbTracker(Tracker):
    """A Weights & Biases run (online, or offline with WANDB_MODE=offline) in `<workdir>/wandb`."""

    def __init__(self, log, workdir, params, run_id):
        super().__init__(log, workdir, params, run_id)
        import wandb

        self.run_id = run_id or uuid.uuid4().hex[:12]
        self._run = wandb.init(
            project=log.wandb_project,
            entity=log.wandb_entity or None,
            dir=workdir,
            id=self.run_id,
            resume="allow",
            name=os.path.basename(os.path.normpath(workdir)),
            config=params,
        )

    def log(self, step, scalars):
        self._run.log(dict(scalars), step=step)

    def artifact(self, path):
        self._run.save(path, base_path=os.path.dirname(path), policy="now")

    def close(self):
        self._run.finish()


class MlflowTracker(Tracker):
    """An MLflow run in experiment `log.mlflow_experiment` at `log.mlflow_uri`."""

    def __init__(self, log, workdir, params, run_id):
        super().__init__(log, workdir, params, run_id)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = log.mlflow_uri or os.path.join(workdir, "mlruns")
        if "://" not in uri or uri.startswith("file:"):
            # A folder store works in MLflow 3 but must be asked for; the database stores
            # need the full mlflow package (sqlalchemy), the folder store does not.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            experiment = self._client.get_experiment_by_name(log.mlflow_experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self._client.create_experiment(log.mlflow_experiment)
            )
            name = os.path.basename(os.path.normpath(workdir))
            self.run_id = self._client.create_run(experiment_id, run_name=name).info.run_id
            # MLflow names take no brackets: train.phases[0].seq_len -> train.phases.0.seq_len.
            items = [
                Param(re.sub(r"\[(\d+)\]", r".\1", k), str(v)[:6000])
                for k, v in sorted(params.items())
            ]
            for start in range(0, len(items), 100):  # MLflow takes 100 parameters per batch
                self._client.log_batch(self.run_id, params=items[start : start + 100])
        else:
            self._client.update_run(self.run_id, status="RUNNING")

    def log(self, step, scalars):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in scalars.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def artifact(self, path):
        self._client.log_artifact(self.run_id, path)

    def close(self):
        self._client.set_terminated(self.run_id)


TRACKERS: dict[str, type[Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


def register_tracker(name: str, cls: type[Tracker]) -> None:
    """Makes `cls` available as `--config.log.trackers=name`."""
    TRACKERS[name] = cls


def run_params(cfg: config_lib.ExperimentConfig, launch: Mapping | None = None) -> dict:
    """The run's parameters as trackers take them: every config field by its command-line path,
    plus the launch record (`workdir.record_launch`: git state, command line, host, devices)
    under `launch.`, its copy of the config and package list left out."""
    params = config_lib.field_paths(config_lib.to_dict(cfg))
    left_out = ("config", "packages")
    params.update({f"launch.{k}": v for k, v in (launch or {}).items() if k not in left_out})
    return {
        k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v) for k, v in params.items()
    }


def check_trackers(log: config_lib.LogConfig) -> None:
    """Every name in `log.trackers` resolves, else a ConfigError naming the field: checked
    before a run's folder exists or any work starts, so a misspelled tracker costs nothing."""
    for name in log.trackers:
        _tracker_class(name)


def _tracker_class(name: str) -> type[Tracker]:
    try:
        return plugins.resolve(TRACKERS, name, "tracker")
    except ValueError as error:
        raise config_lib.ConfigError(f"log.trackers: {error}") from None


def start_trackers(
    log: config_lib.LogConfig, workdir: str, params: dict, resume: bool
) -> list[Tracker]:
    """The trackers of `log`, each continuing its run of this workdir when `resume`; a tracker
    that cannot start is a ConfigError naming it."""
    ids_file = epath.Path(workdir) / TRACKERS_FILE
    ids = json.loads(ids_file.read_text()) if resume and ids_file.exists() else {}
    started = []
    classes = {name: _tracker_class(name) for name in log.trackers}  # all, before any starts
    for name, tracker_class in classes.items():
        try:
            started.append(tracker_class(log, workdir, params, ids.get(name)))
        except ImportError as error:
            for tracker in started:
                tracker.close()
            raise config_lib.ConfigError(
                f"log.trackers: {name} needs the tracking extra (pip install -e .[tracking]): "
                f"{first_line(error)}"
            ) from None
        except Exception as error:  # the tracker's own: a bad URI, credentials, the network
            for tracker in started:
                tracker.close()
            raise config_lib.ConfigError(
                f"log.trackers: {name} could not start ({type(error).__name__}: "
                f"{first_line(error)})"
            ) from None
        ids[name] = started[-1].run_id
    if started:
        ids_file.write_text(json.dumps(ids, indent=2))
    return started


def numeric(record: Mapping[str, object]) -> dict[str, float]:
    """The numbers of a metrics record (its step aside), as trackers take them."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
