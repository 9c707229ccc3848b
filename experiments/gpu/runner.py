"""Runs a plan of cases in worker processes under per-case timeouts and an overall budget.

Cases sharing a `group` run in one worker process, in order (a GEMM shape's backends share their
inputs; model cases get a process each so their peak memory is theirs alone). The parent never
imports JAX (it would take GPU memory). A case that outlives its timeout gets its worker killed
(the whole process group) and is recorded as "timeout"; a worker that dies records "crash" with
the tail of its log; either way a fresh worker continues with the group's remaining cases. Cases
that no longer fit in the budget are recorded as "skipped".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

STARTUP_S = 120  # importing JAX and initialising the device, before the first case starts
POLL_S = 0.2
MIN_START_S = 15  # no new worker with less budget than this left


def _groups(cases: list[dict]) -> list[list[dict]]:
    groups: list[list[dict]] = []
    for case in cases:
        if groups and groups[-1][0]["group"] == case["group"]:
            groups[-1].append(case)
        else:
            groups.append([case])
    return groups


def _read_events(path: str, offset: int) -> tuple[list[dict], int]:
    """New complete JSON lines of the events file since `offset`."""
    if not os.path.exists(path):
        return [], offset
    with open(path) as f:
        f.seek(offset)
        text = f.read()
    complete = text[: text.rfind("\n") + 1]
    events = [json.loads(line) for line in complete.splitlines() if line.strip()]
    return events, offset + len(complete)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _log_tail(path: str, chars: int = 1500) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def run_plan(
    cases: list[dict],
    *,
    dry_run: bool,
    budget_s: float,
    env: dict | None = None,
    on_result=None,
) -> list[dict]:
    """Runs `cases`, returns one result per case (in plan order). The workers' specs, events and
    logs live in a temporary folder removed afterwards: only the report comes back from a lent
    machine, so a failure's log tail travels in its result."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        return _run_groups(cases, work, dry_run, budget_s, env, on_result)


def _run_groups(cases, work, dry_run, budget_s, env, on_result) -> list[dict]:
    deadline = time.monotonic() + budget_s
    results: dict[str, dict] = {}

    def record(case, result):
        result = {"name": case["name"], "kind": case["kind"], "group": case["group"], **result}
        results[case["name"]] = result
        if on_result is not None:
            on_result(result)

    for index, group in enumerate(_groups(cases)):
        pending = list(group)
        attempt = 0
        while pending:
            if deadline - time.monotonic() < MIN_START_S:
                for case in pending:
                    record(case, {"status": "skipped", "reason": "out of the time budget"})
                break
            stem = os.path.join(work, f"{index:02d}-{attempt}")
            spec_path, events_path, log_path = stem + ".json", stem + ".events", stem + ".log"
            with open(spec_path, "w") as f:
                json.dump({"dry_run": dry_run, "cases": pending}, f)
            with open(log_path, "w") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "experiments.gpu.worker", spec_path, events_path],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # its own process group: kill it whole
                )
            attempt += 1
            offset, started_at = 0, None
            limit_at = time.monotonic() + STARTUP_S
            while pending:
                events, offset = _read_events(events_path, offset)
                for event in events:
                    if event["event"] == "start":
                        started_at = time.monotonic()
                        limit_at = started_at + pending[0]["timeout_s"]
                    else:
                        case = pending.pop(0)
                        event.pop("event")
                        event.pop("name")
                        record(case, event)
                        started_at = None
                if not pending:
                    break
                now = time.monotonic()
                if proc.poll() is not None:
                    events, offset = _read_events(events_path, offset)
                    if events:
                        continue  # results written just before exiting
                    record(pending.pop(0), {"status": "crash", "log_tail": _log_tail(log_path)})
                    break
                if now > min(limit_at, deadline):
                    _kill(proc)
                    what = "timeout" if started_at is not None else "crash"
                    reason = (
                        f"no result after {now - started_at:.0f}s"
                        if started_at is not None
                        else "worker did not start"
                    )
                    if now > deadline:
                        reason += " (time budget reached)"
                    record(
                        pending.pop(0),
                        {"status": what, "reason": reason, "log_tail": _log_tail(log_path)},
                    )
                    break
                time.sleep(POLL_S)
            if proc.poll() is None:  # finished its cases: let it exit
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    _kill(proc)
    return [results[c["name"]] for c in cases if c["name"] in results]
