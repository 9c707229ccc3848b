"""One metrics writer: JSONL (the record a resumed run keeps consistent) plus TensorBoard."""

from __future__ import annotations

import json
import math
import os
from typing import Mapping

import numpy as np


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
            kept = [line for line in read_metrics(self.path) if line["step"] <= resume_step]
            with open(self.path, "w") as f:
                f.writelines(json.dumps(line) + "\n" for line in kept)
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
    """All records of a metrics.jsonl file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
