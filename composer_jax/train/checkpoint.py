"""Orbax checkpoints of the whole training state plus JSON metadata (phase, data iterator state).

The train state is saved as a flat {tree path: array} mapping, so any pytree node type (NNX state,
optax states) round-trips, and a restore can name exactly which tensors a bad checkpoint lacks.
Saves are asynchronous: training continues while the previous step is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from composer_jax.train.workdir import first_line, run_path

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match the model being trained."""


class CheckpointMismatch(CheckpointError):
    """A readable checkpoint of another model (names or shapes differ): a configuration error,
    never a reason to fall back to an older checkpoint."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint that cannot be read (missing or corrupt files)."""


def _key_name(path) -> str:
    """A storage-safe name for a tree path: its entries joined by '__'."""
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                parts.append(re.sub(r"[^A-Za-z0-9_]", "_", str(getattr(entry, attr))))
                break
    return "__".join(parts)


def _flatten(tree) -> tuple[dict[str, Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat = {_key_name(path): leaf for path, leaf in leaves}
    if len(flat) != len(leaves):
        raise CheckpointError("two state entries map to the same checkpoint name")
    return flat, treedef


class _TolerantLoop(asyncio.SelectorEventLoop):
    """An event loop that drops wake-ups scheduled after it closed, and the unretrieved
    exceptions of reads abandoned by a failed restore.

    Orbax reads a checkpoint on a fresh loop and closes it as soon as one read fails; the reads
    still in flight then finish in tensorstore's threads and schedule their wake-ups on the
    closed loop, each printing a traceback (thousands on a large state) around the one warning
    that matters. Nobody awaits them any more, so dropping them loses nothing."""

    def call_soon_threadsafe(self, callback, *args, context=None):
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        except RuntimeError:
            if self.is_closed():
                return None
            raise

    def call_exception_handler(self, context):
        """Drops "Task exception was never retrieved": the other reads of a damaged checkpoint
        fail too, and their tasks are collected unawaited after the first failure ended the
        restore (a traceback each); the restore's own error is the one reported."""
        if "exception was never retrieved" in str(context.get("message", "")):
            return
        super().call_exception_handler(context)


class _TolerantLoops(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _TolerantLoop()


class _DropOrbaxErrors(logging.Filter):
    """Orbax's own error log of an unreadable file: `restore_latest` says it once, plainly."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or "orbax" not in record.pathname


@contextlib.contextmanager
def _quiet_failed_reads():
    """While a checkpoint that may be damaged is read: loops made meanwhile (orbax makes one per
    read) tolerate late wake-ups, and orbax's error log is left out. The event loop policy is
    the hook asyncio offers for choosing the loop class (deprecated from Python 3.14, where
    asyncio.new_event_loop still consults it)."""
    policy = asyncio.get_event_loop_policy()
    quiet = _DropOrbaxErrors()
    asyncio.set_event_loop_policy(_TolerantLoops())
    logging.getLogger("absl").addFilter(quiet)
    try:
        yield
    finally:
        logging.getLogger("absl").removeFilter(quiet)
        asyncio.set_event_loop_policy(policy)


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: int, async_save: bool = True):
        self.directory = str(run_path(directory, "checkpoint directory"))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save
        )
        with _quiet_failed_reads():  # it reads every step's metadata, damaged ones too
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=options,
                item_handlers={
                    "state": ocp.StandardCheckpointHandler(),
                    "metadata": ocp.JsonCheckpointHandler(),
                },
            )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, metadata: dict) -> None:
        flat, _ = _flatten(state)
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(flat), metadata=ocp.args.JsonSave(metadata)
            ),
        )

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores into the structure, shapes and shardings of `abstract_state`."""
        target, treedef = _flatten(abstract_state)
        try:
            stored = self._manager.item_metadata(step)["state"]
        except Exception as e:  # Orbax raises several types for unreadable folders.
            raise CheckpointDamaged(
                f"checkpoint {self.directory}/{step} is unreadable: {first_line(e)}"
            ) from e
        if stored is not None:
            missing = sorted(set(target) - set(stored))
            unexpected = sorted(set(stored) - set(target))
            if missing or unexpected:
                raise CheckpointMismatch(
                    f"checkpoint {self.directory}/{step} does not match the model: missing "
                    f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                    f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
                )
            for key, spec in target.items():
                shape = tuple(getattr(stored[key], "shape", spec.shape))
                if shape != tuple(spec.shape):
                    raise CheckpointMismatch(
                        f"checkpoint tensor {key} has shape {shape}, "
                        f"the model expects {tuple(spec.shape)}"
                    )
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), metadata=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:
            raise CheckpointDamaged(
                f"failed to restore {self.directory}/{step}: {first_line(e)}"
            ) from e
        state = jax.tree_util.tree_unflatten(treedef, [restored["state"][k] for k in target])
        return state, dict(restored["metadata"])

    def restore_latest(
        self, abstract_state: Any, set_aside: bool = True
    ) -> tuple[int, Any, dict] | None:
        """(step, state, metadata) of the newest checkpoint that restores, or None when there is
        none. A damaged checkpoint is skipped with a warning (and, with `set_aside`, renamed
        `<step>.damaged` so the resumed run can save that step again) and the previous one is
        tried; a mismatch stops at once, and so does finding none intact (at that start and at
        every later one: only set-aside checkpoints left is an error, not a fresh run)."""
        failures = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                with _quiet_failed_reads():
                    state, metadata = self.restore(step, abstract_state)
            except CheckpointDamaged as error:
                failures.append(str(error))
                if set_aside:
                    if jax.process_index() == 0:  # one rename; the others wait for it
                        folder = epath.Path(self.directory)
                        aside, n = folder / f"{step}.damaged", 1
                        while aside.exists():
                            aside, n = folder / f"{step}.damaged-{n}", n + 1
                        (folder / str(step)).rename(aside)
                    if jax.process_count() > 1:
                        multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
                    self._manager.reload()
                log.warning("%s; trying the previous checkpoint", error)
                continue
            if failures:
                log.warning("resuming from the intact checkpoint %s/%d", self.directory, step)
            return step, state, metadata
        if failures:
            raise CheckpointDamaged(
                f"no checkpoint in {self.directory} restores: " + "; ".join(failures)
            )
        folder = epath.Path(self.directory)
        aside = sorted(p.name for p in folder.glob("*.damaged*")) if folder.exists() else []
        if aside:  # an earlier start set every one aside: starting over would pass for a resume
            raise CheckpointDamaged(
                f"no checkpoint in {self.directory} restores: every one was set aside as damaged "
                f"({', '.join(aside)}); rename one back to its step to try it again, or start "
                "the run in a new folder"
            )
        return None

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
