"""One metrics writer: JSONL (the record a resumed run keeps consistent) plus TensorBoard."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from typing import Mapping

import numpy as np

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
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.is_writer = is_writer
        self._tb = None
        if not is_writer:
            return
        os.makedirs(workdir, exist_ok=True)
        if resume_step is not None and os.path.exists(self.path):
            records, damaged = _parse(self.path)
            if damaged:
                copy = f"{self.path}.damaged-{int(time.time())}"
                shutil.copyfile(self.path, copy)
                log.warning(
                    "%s: line(s) %s are torn or garbled (a crash mid-write?); kept the good "
                    "records, the original is in %s",
                    self.path,
                    damaged[:5],
                    copy,
                )
            kept = [line for line in records if line["step"] <= resume_step]
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                f.writelines(json.dumps(line) + "\n" for line in kept)
            os.replace(tmp, self.path)
        elif resume_step is None and os.path.exists(self.path):
            os.remove(self.path)  # A fresh run in an old workdir starts a fresh record.
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, scalars: Mapping[str, object]) -> dict[str, float]:
        record = {"step": int(step), **{k: _scalar(v) for k, v in scalars.items()}}
        if self.is_writer:
            with open(self.path, "a") as f:
                f.write(
                    json.dumps(
                        {
                            k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                            for k, v in record.items()
                        }
                    )
                    + "\n"
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
    with open(path, "rb") as f:
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
