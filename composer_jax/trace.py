"""A timeline of the actor loop as a Chrome / Perfetto trace (the JSON trace-event format).

`Tracer.span(category, name)` records a complete event ("ph": "X") on the calling thread's track
(named with `name_thread`, or by `track=`); `complete` records one timed elsewhere (a weight
publication on the publisher's thread). While a tracer is entered (`with tracer:`), JAX's own
compilation timings (`jax.monitoring` time spans) land on the compiling thread's track as
category "compile". `write` saves the trace (open it in ui.perfetto.dev or chrome://tracing) and
a summary table next to it. Runs without tracing get `NULL_TRACER`: its spans are one shared
no-op context (no clock, no lock), so instrumented code costs a method call when tracing is off.

A `jax.profiler` trace is another thing (XLA ops on the device); it is also a Chrome trace, on its
own clock, so open the two side by side in Perfetto rather than merging them.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time

# Tracks and the categories that count as their role being busy (the summary's busy fractions).
SAMPLER, TRAINER = "sampler", "trainer"
BUSY = {
    SAMPLER: ("decode", "prefill", "prefix_copy", "emit", "weight_reload"),
    TRAINER: ("pack", "reference", "train_step", "publish_dispatch", "checkpoint"),
}
_JAX_COMPILE = "/jax/core/compile/"


class NullTracer:
    """Tracing off: every span is the same no-op context."""

    enabled = False
    _NULL = contextlib.nullcontext()

    def span(self, category: str, name: str | None = None, track: str | None = None, **args):
        return self._NULL

    def complete(self, *args, **kwargs) -> None:
        pass

    def name_thread(self, track: str) -> None:
        pass

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


NULL_TRACER = NullTracer()


class Tracer:
    """Collects complete events from any thread (one lock around an append)."""

    enabled = True

    def __init__(self):
        self._lock = threading.Lock()
        self._events: list[tuple] = []  # (track, category, name, start, end, args), seconds
        self._local = threading.local()
        self.origin = time.perf_counter()
        self._wall_origin = time.time()  # jax.monitoring reports time.time()
        self.end: float | None = None

    def start(self) -> None:
        """The timeline starts now; JAX compilations are recorded until `close`."""
        self.origin, self._wall_origin = time.perf_counter(), time.time()
        _listen(self)

    def close(self) -> None:
        """The timeline ends now (the first call counts)."""
        _unlisten(self)
        if self.end is None:
            self.end = time.perf_counter()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def name_thread(self, track: str) -> None:
        """Names the calling thread's track (e.g. "sampler" for the rollout thread)."""
        self._local.track = track

    def _track(self) -> str:
        return getattr(self._local, "track", None) or threading.current_thread().name

    @contextlib.contextmanager
    def span(self, category: str, name: str | None = None, track: str | None = None, **args):
        """Times the block; the event is recorded even when the block raises."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.complete(category, name, start, time.perf_counter(), track, **args)

    def complete(
        self,
        category: str,
        name: str | None,
        start: float,
        end: float,
        track: str | None = None,
        **args,
    ) -> None:
        """An event timed by the caller (`time.perf_counter()` seconds)."""
        event = (track or self._track(), category, name or category, start, end, args)
        with self._lock:
            self._events.append(event)

    def _on_jax_span(self, event: str, start: float, end: float, **kwargs) -> None:
        if event.startswith(_JAX_COMPILE):
            shift = self.origin - self._wall_origin
            name = f"{event[len(_JAX_COMPILE) :]} {kwargs.get('fun_name', '')}".strip()
            self.complete("compile", name, start + shift, end + shift)

    def events(self) -> list[dict]:
        """The trace events: thread-name metadata, then complete events in microseconds."""
        with self._lock:
            recorded = list(self._events)
        tracks = {SAMPLER: 1, TRAINER: 2}
        for track, *_ in recorded:
            tracks.setdefault(track, len(tracks) + 1)
        out = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "actor loop"}}]
        for track, tid in tracks.items():
            out.append(
                {"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": track}}
            )
            out.append(
                {
                    "ph": "M",
                    "pid": 1,
                    "tid": tid,
                    "name": "thread_sort_index",
                    "args": {"sort_index": tid},
                }
            )
        for track, category, name, start, end, args in sorted(recorded, key=lambda e: e[3]):
            # The duration as a difference of the two offsets, so that a span that ends where
            # the next one starts (one clock reading) also ends there in the trace, not a
            # rounding error later: the viewer would nest the next span inside it.
            begin_us = (start - self.origin) * 1e6
            out.append(
                {
                    "ph": "X",
                    "pid": 1,
                    "tid": tracks[track],
                    "cat": category,
                    "name": name,
                    "ts": begin_us,
                    "dur": (end - self.origin) * 1e6 - begin_us,
                    "args": args,
                }
            )
        return out

    def write(self, path: str) -> dict:
        """Closes the timeline, writes the trace to `path` and the summary table to
        `summary_path(path)`; returns the summary (see `summarize`)."""
        self.close()
        events = self.events()
        wall = self.end - self.origin
        summary = summarize(events, wall)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            json.dump(
                {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"wall_s": wall}}, f
            )
        with open(summary_path(path), "w") as f:
            f.write(format_summary(summary) + "\n")
        return summary


def summary_path(trace_path: str) -> str:
    return trace_path.removesuffix(".json") + ".summary.txt"


def _union(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _overlaps(start: float, end: float, intervals: list[tuple[float, float]]) -> bool:
    return any(s < end and start < e for s, e in intervals)


def summarize(events: list[dict], wall_s: float) -> dict:
    """Busy fraction of the sampler and trainer tracks over the wall time (union of their busy
    categories' events), then per (track, category): count and seconds; decode calls' mean
    running rows and duration alone vs during a train step (a call decodes up to the engine's
    `decode_chunk` tokens per row); the sampler's host work (emit and rollout_host) per decoded
    token."""
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    seconds = lambda e: e["dur"] / 1e6  # noqa: E731
    interval = lambda e: (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)  # noqa: E731
    busy = {}
    for role, categories in BUSY.items():
        mine = [interval(e) for e in spans if names[e["tid"]] == role and e["cat"] in categories]
        busy[role] = _union(mine) / wall_s if wall_s > 0 else 0.0
    table = collections.defaultdict(lambda: [0, 0.0])
    for e in spans:
        row = table[(names[e["tid"]], e["cat"])]
        row[0] += 1
        row[1] += seconds(e)
    decodes = [e for e in spans if e["cat"] == "decode"]
    training = [interval(e) for e in spans if e["cat"] in ("train_step", "reference")]
    during = [seconds(e) for e in decodes if _overlaps(*interval(e), training)]
    alone = [seconds(e) for e in decodes if not _overlaps(*interval(e), training)]
    tokens = sum(e["args"].get("tokens", 0) for e in decodes)
    rows = sum(e["args"].get("running", 0) for e in decodes)
    host = sum(seconds(e) for e in spans if e["cat"] in ("emit", "rollout_host"))
    return {
        "wall_s": wall_s,
        "busy": busy,
        "categories": {f"{t}/{c}": {"count": n, "seconds": s} for (t, c), (n, s) in table.items()},
        "decode_steps": len(decodes),
        "decoded_tokens": tokens,
        "decode_rows_mean": rows / max(len(decodes), 1),
        "host_ms_per_token": 1e3 * host / max(tokens, 1),  # the sampler's emit + rollout_host
        "decode_ms_alone": 1e3 * sum(alone) / max(len(alone), 1),
        "decode_ms_during_train": 1e3 * sum(during) / max(len(during), 1),
        "decode_steps_during_train": len(during),
    }


def format_summary(summary: dict) -> str:
    """The summary as a markdown table plus the decode lines."""
    wall = summary["wall_s"]
    lines = [
        f"actor loop: {wall:.1f} s wall; busy: sampler {summary['busy'][SAMPLER]:.1%}, "
        f"trainer {summary['busy'][TRAINER]:.1%}",
        "",
        "| track | category | count | seconds | mean ms | % of wall |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    rows = sorted(summary["categories"].items(), key=lambda kv: -kv[1]["seconds"])
    for key, row in rows:
        track, category = key.split("/", 1)
        n, s = row["count"], row["seconds"]
        share = s / wall if wall > 0 else 0.0
        lines.append(f"| {track} | {category} | {n} | {s:.2f} | {1e3 * s / n:.1f} | {share:.1%} |")
    lines += [
        "",
        f"decode: {summary['decode_steps']} calls, {summary['decoded_tokens']} tokens, "
        f"{summary['decode_rows_mean']:.1f} running rows per call; "
        f"{summary['decode_ms_alone']:.1f} ms per call alone, "
        f"{summary['decode_ms_during_train']:.1f} ms during a train step "
        f"({summary['decode_steps_during_train']} calls); sampler host work "
        f"{summary['host_ms_per_token']:.2f} ms per decoded token",
    ]
    return "\n".join(lines)


_listening: list[Tracer] = []
_registered = False
_registry_lock = threading.Lock()


def _listen(tracer: Tracer) -> None:
    """Forwards JAX's compilation time spans to the entered tracers (one listener for all)."""
    global _registered
    import jax.monitoring

    with _registry_lock:
        if not _registered:
            jax.monitoring.register_event_time_span_listener(_forward)
            _registered = True
        _listening.append(tracer)


def _unlisten(tracer: Tracer) -> None:
    with _registry_lock:
        if tracer in _listening:
            _listening.remove(tracer)


def _forward(event: str, start: float, end: float, **kwargs) -> None:
    for tracer in list(_listening):
        tracer._on_jax_span(event, start, end, **kwargs)


def make_tracer(path: str) -> Tracer | NullTracer:
    """A tracer when `path` names a trace file, else the no-op one."""
    return Tracer() if path else NULL_TRACER
