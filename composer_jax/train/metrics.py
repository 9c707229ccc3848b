"""One metrics writer: JSONL (the record a resumed run keeps consistent) plus the run's trackers
(TensorBoard, W&B, MLflow: `train.trackers`), which get every record with the same step.

Paths go through `etils.epath`, so a bucket workdir keeps its `metrics.jsonl` there too."""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Mapping

import numpy as np
from etils import epath

from composer_jax import config as config_lib
from composer_jax.train.trackers import Tracker, numeric, start_trackers
from composer_jax.train.workdir import append_line

log = logging.getLogger(__name__)


def _scalar(v) -> float:
    return float(np.asarray(v))


class MetricsWriter:
    """Appends `{"step": s, ...}` lines to `<workdir>/metrics.jsonl` and hands each record to the
    trackers of `log_config` (TensorBoard by default; `train.trackers`), `params` being the run's
    parameters they record.

    `resume_step` drops lines written after that step by a run that was killed, so that the file of a
    resumed run reads exactly like an uninterrupted one.
    """

    def __init__(
        self,
        workdir: str,
        resume_step: int | None = None,
        is_writer: bool = True,
        log_config: config_lib.LogConfig = config_lib.LogConfig(),
        params: dict | None = None,
    ):
        self._file = epath.Path(workdir) / "metrics.jsonl"
        self.path = str(self._file)
        self.is_writer = is_writer
        self.trackers: list[Tracker] = []
        if not is_writer:
            return
        self._file.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self._file.exists():
            records, damaged = _parse(self._file)
            if damaged:
                copy = self._file.parent / f"{self._file.name}.damaged-{int(time.time())}"
                self._file.copy(copy)
                log.warning(
                    "%s: line(s) %s are torn or garbled (a crash mid-write?); kept the good "
                    "records, the original is in %s",
                    self._file,
                    damaged[:5],
                    copy,
                )
            kept = [line for line in records if line["step"] <= resume_step]
            tmp = self._file.parent / f"{self._file.name}.tmp"
            tmp.write_text("".join(json.dumps(line) + "\n" for line in kept))
            tmp.replace(self._file)
        elif resume_step is None and self._file.exists():
            self._file.unlink()  # A fresh run in an old workdir starts a fresh record.
        self.trackers = start_trackers(
            log_config, workdir, params or {}, resume=resume_step is not None
        )

    def write(self, step: int, scalars: Mapping[str, object]) -> dict[str, float]:
        record = {"step": int(step), **{k: _scalar(v) for k, v in scalars.items()}}
        if self.is_writer:
            append_line(
                self._file,
                json.dumps(
                    {
                        k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                        for k, v in record.items()
                    }
                ),
            )
            scalars = numeric(record)
            for tracker in self.trackers:
                tracker.log(record["step"], scalars)
        return record

    def artifact(self, path: str) -> None:
        """Hands the file at `path` to every tracker that keeps files."""
        for tracker in self.trackers:
            tracker.artifact(path)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def read_metrics(path: str) -> list[dict]:
    """All records of a metrics.jsonl file, in order; torn or garbled lines are skipped (with a
    warning naming them)."""
    records, damaged = _parse(path)
    if damaged:
        log.warning("%s: skipped torn or garbled line(s) %s", path, damaged[:5])
    return records


def _parse(path: str) -> tuple[list[dict], list[int]]:
    """(records, 1-based numbers of the lines that are not a JSON object with a step)."""
    records, damaged = [], []
    with epath.Path(path).open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                damaged.append(number)
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
            else:
                damaged.append(number)
    return records, damaged
