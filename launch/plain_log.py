"""Plain progress lines for logs (`--noprogress`): a background thread follows the run's
`metrics.jsonl` files and prints the newest record at most every `--log_every_s` seconds, or
(`--log_every_steps=N`) one line each time a run passes a multiple of N steps, so a batch job's
log shows where the run is without progress-bar control characters.

Reading the metrics file keeps the training loops untouched: whatever they record is what is
shown, as soon as it is written.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from absl import flags
from etils import epath

# Shown first when present, in this order; other scalars follow up to `MAX_FIELDS`.
PREFERRED = (
    "loss",
    "eval_nll",
    "reward_mean",
    "rollout_reward",
    "pass_rate",
    "heldout_reward",
    "kl_k1",
    "length_penalty",
    "staleness_mean",
    "tokens_per_second",
    "seconds_per_step",
)
MAX_FIELDS = 8


_EVERY_STEPS: flags.FlagHolder | None = None


def define_flags() -> tuple[flags.FlagHolder, flags.FlagHolder]:
    """`--progress` (bars; `--noprogress` for plain lines), `--log_every_s` and
    `--log_every_steps` (read by `progress_context`)."""
    global _EVERY_STEPS
    progress = flags.DEFINE_bool(
        "progress", True, "Progress bars; --noprogress prints plain lines instead (for logs)."
    )
    every = flags.DEFINE_float(
        "log_every_s",
        30.0,
        "With --noprogress: seconds between plain progress lines.",
        lower_bound=0.1,
    )
    _EVERY_STEPS = flags.DEFINE_integer(
        "log_every_steps",
        0,
        "With --noprogress: a line each time the run passes a multiple of this many steps "
        "(instead of every --log_every_s seconds); 0 = off.",
        lower_bound=0,
    )
    return progress, every


def format_record(label: str, record: dict, total: int | None) -> str:
    """`[hh:mm:ss] label step 12/300 (4%): loss=2.31 eval_nll=...`."""
    step = record.get("step", 0)
    where = f"{step}/{total} ({100 * step / total:.0f}%)" if total else f"{step}"
    keys = [k for k in PREFERRED if k in record]
    keys += sorted(k for k in record if k not in keys and k != "step")
    fields = []
    for key in keys[:MAX_FIELDS]:
        value = record[key]
        fields.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return f"[{time.strftime('%H:%M:%S')}] {label} step {where}: {' '.join(fields)}"


class _Follower:
    """The complete lines appended to one metrics file since the last read; a file that shrank
    (rewritten by a resumed run) is read again from its start."""

    def __init__(self, label: str, path: str, total: int | None, every_steps: int = 0):
        self.label, self.path, self.total = label, path, total
        self.every_steps = every_steps
        self.offset = 0
        self.latest: dict | None = None
        self.shown: dict | None = None
        self.due: list[dict] = []  # step mode: complete records that passed a multiple
        self.shown_block = 0  # the block of steps [0, N) passes no multiple

    def poll(self) -> None:
        path = epath.Path(self.path)  # a bucket workdir's metrics too
        try:
            size = path.stat().length
        # Not there yet, or a file system this machine cannot reach (a scheme without its
        # client): the run itself says why in one line.
        except (OSError, ImportError, ValueError):
            return
        if size < self.offset:
            self.offset = 0
        with path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "step" in record:
                # Records of one step may come in several lines (e.g. eval after train).
                same = self.latest is not None and self.latest.get("step") == record["step"]
                if not same and self.latest is not None:
                    self._complete(self.latest)
                self.latest = {**self.latest, **record} if same else record

    def _complete(self, record: dict) -> None:
        """A record no later line can add to: due in step mode when it passed a multiple."""
        if self.every_steps and record["step"] // self.every_steps > self.shown_block:
            self.shown_block = record["step"] // self.every_steps
            self.due.append(record)

    def due_lines(self) -> list[str]:
        """Step mode: the lines of the records that passed a multiple since the last call."""
        lines = [format_record(self.label, r, self.total) for r in self.due]
        if self.due:
            self.shown = self.due[-1]
        self.due = []
        return lines

    def line(self) -> str | None:
        if self.latest is None or self.latest == self.shown:
            return None
        self.shown = self.latest
        return format_record(self.label, self.latest, self.total)


class PlainProgress:
    """Context manager: while it is open, prints the newest record of `files` ((label, path,
    total steps) each) every `every_s` seconds if there is a new one, or with `every_steps` a line
    per multiple of that many steps passed; and the newest once more at the end."""

    def __init__(
        self,
        files: list[tuple[str, str, int | None]],
        every_s: float,
        out=None,
        every_steps: int = 0,
    ):
        if every_s <= 0:
            raise ValueError(f"--log_every_s must be positive, got {every_s}")
        self.followers = [_Follower(*f, every_steps=every_steps) for f in files]
        self.every_s = min(every_s, 1.0) if every_steps else every_s
        self.every_steps = every_steps
        self.out = out or sys.stdout
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="plain-progress", daemon=True)

    def __enter__(self) -> PlainProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.flush(final=True)

    def flush(self, final: bool = False) -> None:
        for follower in self.followers:
            follower.poll()
            lines = follower.due_lines() if self.every_steps else []
            if final or not self.every_steps:
                lines += [line for line in [follower.line()] if line]
            for line in lines:
                print(line, file=self.out, flush=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.flush()


def progress_context(files, progress: bool, every_s: float):
    """PlainProgress over `files` when bars are off; a no-op context when they are on, and on
    every process of a multi-process job but the first (they would print the same lines)."""
    import contextlib

    import jax

    if progress or jax.process_index() != 0:
        return contextlib.nullcontext()
    every_steps = _EVERY_STEPS.value if _EVERY_STEPS is not None else 0
    return PlainProgress(files, every_s, every_steps=every_steps)
