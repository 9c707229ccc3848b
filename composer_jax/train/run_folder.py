"""`RunFolder`: one run's folder as every entry point opens it, a run that trains into it
(`RunFolder.start`: pretraining, an RL run, its SFT warm start) or a finished run read back
(`RunFolder.open`: `load_run`, so `launch.evaluate`, `launch.export` and an RL warm start).

A start goes in one order, so that a refused start creates nothing and leaves an old run's files
as they were: the tokenizer is resolved and the resume checked before the folder is made;
checkpoints are restored; only then does `commit` write the config, append the launch record and
keep the tokenizer's files (process 0 alone). The rules themselves live in `train.workdir`
(paths, resume, launch records) and `train.runs` (the tokenizer); the train state's checkpoints
are one orbax `Checkpointer` at `<folder>/checkpoints`, opened on first use.
"""

from __future__ import annotations

import os
from typing import Any

import jax
from etils import epath
from jax.experimental import multihost_utils

from composer_jax import config as config_lib
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.train import runs
from composer_jax.train import workdir as workdir_lib
from composer_jax.train.checkpoint import Checkpointer
from composer_jax.train.metrics import read_metrics

CHECKPOINTS = "checkpoints"


class RunFolder:
    """A run's folder (a local path or a `gs://` URI), its config, its tokenizer and its
    train state's checkpoints."""

    def __init__(
        self, path: str, cfg: config_lib.ExperimentConfig, tokenizer: Tokenizer | None = None
    ):
        self.path = str(path)
        self.cfg = cfg
        self._tokenizer = tokenizer
        self._checkpointer: Checkpointer | None = None

    @classmethod
    def start(cls, cfg: config_lib.ExperimentConfig) -> RunFolder:
        """The folder `cfg` trains into (`cfg.workdir`), created; ConfigErrors name the field
        (a tokenizer that cannot be used, a resume `cfg.resume` forbids, a changed config or
        tokenizer, a folder that cannot be made or written) before anything is written."""
        tokenizer = runs.resolve_tokenizer(cfg)
        workdir = str(workdir_lib.run_path(cfg.workdir, "workdir"))
        if workdir_lib.check_resume(workdir, cfg):
            runs.check_run_tokenizer(workdir, tokenizer)
        if jax.process_count() > 1:  # every process has judged the folder before process 0 writes
            multihost_utils.sync_global_devices("checked the workdir")
        return cls(workdir_lib.prepare_workdir(cfg.workdir), cfg, tokenizer)

    @classmethod
    def open(cls, path: str, field: str = "workdir") -> RunFolder:
        """A finished run's folder, its stored config read; a ConfigError naming `field` when
        `path` holds no run."""
        workdir_lib.check_run_folder(path, field)
        return cls(path, workdir_lib.read_run_config(path))

    @property
    def tokenizer(self) -> Tokenizer:
        """The run's tokenizer: resolved from the config at a start, else the run's own."""
        if self._tokenizer is None:
            self._tokenizer = runs.run_tokenizer(self.path)
        return self._tokenizer

    def metrics(self) -> list[dict]:
        """The run's metrics records (none before its first step)."""
        path = epath.Path(self.path) / "metrics.jsonl"
        return read_metrics(path) if path.exists() else []

    def commit(self, resumed_step: int | None, kind: str) -> dict | None:
        """Marks this start as the run's, on process 0: the config, the launch record (returned
        for the trackers) and the tokenizer's files; None on the other processes. Called once
        the start can no longer be refused (after the checkpoint restored)."""
        if jax.process_index() != 0:
            return None
        workdir_lib.write_config(self.path, self.cfg)
        launch = workdir_lib.record_launch(self.path, self.cfg, resumed_step, kind)
        runs.save_run_tokenizer(self.tokenizer, self.path)
        return launch

    def _checkpoints(self) -> Checkpointer:
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(
                os.path.join(self.path, CHECKPOINTS), self.cfg.train.keep_checkpoints
            )
        return self._checkpointer

    @property
    def checkpoint_dir(self) -> str:
        """Where the checkpoints are, as messages name it (absolute, or a URI)."""
        return self._checkpoints().directory

    def latest_step(self) -> int | None:
        return self._checkpoints().latest_step()

    def restore_latest(
        self, abstract_state: Any, set_aside: bool = True
    ) -> tuple[int, Any, dict] | None:
        """(step, state, metadata) of the newest intact checkpoint, None when there is none
        (`Checkpointer.restore_latest`: a damaged one is skipped, a mismatch raises)."""
        return self._checkpoints().restore_latest(abstract_state, set_aside)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """(state, metadata) of the checkpoint of `step`."""
        return self._checkpoints().restore(step, abstract_state)

    def save(self, step: int, state: Any, metadata: dict) -> None:
        """Saves the train state of `step` with its metadata, in the background."""
        self._checkpoints().save(step, state, metadata)

    def close(self) -> None:
        """Waits for the checkpoints being written; nothing to do when none were opened."""
        if self._checkpointer is not None:
            self._checkpointer.close()
