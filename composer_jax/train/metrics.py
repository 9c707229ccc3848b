"""One metrics writer: JSONL (the record a resumed run keeps consistent) plus TensorBoard.

Paths go through `etils.epath`, so a bucket workdir keeps its `metrics.jsonl` there too;
TensorBoard is written for local workdirs only."""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Mapping

import numpy as np
from etils import epath

from composer_jax.train.workdir import append_line, is_remote

log = logging.getLogger(__name__)


def _scalar(v) -> float:
    return float(np.asarray(v))


class MetricsWriter:
    """Appends `{"step": s, ...}` lines to `<workdir>/metrics.jsonl` and scalars to TensorBoard.

    `resume_step` drops lines written after that step by a run that was killed, so that the file of a
    resumed run reads exactly like an uninterrupted one.
    """

    def __init__(
        self,
        workdir: str,
        resume_step: int | None = None,
        tensorboard: bool = True,
        is_writer: bool = True,
    ):
        self._file = epath.Path(workdir) / "metrics.jsonl"
        self.path = str(self._file)
        self.is_writer = is_writer
        self._tb = None
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
        if tensorboard and is_remote(workdir):
            log.warning(
                "TensorBoard is written for local workdirs only; %s has every scalar", self._file
            )
        elif tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(epath.Path(workdir) / "tensorboard"))

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
            if self._tb is not None:
                for k, v in record.items():
                    if k != "step":
                        self._tb.add_scalar(k, v, step)
        return record

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


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
