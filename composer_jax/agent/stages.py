"""Where agent episodes fail: each episode on a function-writing task checked stage by stage.

The stages, in the order an episode has to pass them:

    found_file     a successful tool call named the file that holds the target function
    read_function  a successful `read_file` of that file showed a line of the function, or the
                   first observation's open tab showed it whole (passed when the file does not
                   exist at the start)
    body_parses    the file at the end parses, defines the function, and it is not the stub
    visible_test   the task's visible test command passes on that file (a fresh sandbox, as
                   `run_tests` runs it; passed when the task has none)
    hidden_tests   the grader passed every graded test and no monitor flagged the episode
    report         the episode ended with a final message (not by running out of turns)

Each stage is checked on its own ("reached"); an episode is counted at the first it misses
("failed at"), or as "complete". Tasks without one target function (a file to reproduce) are
counted as unknown. The file at the end is the environment's record of the changes, or, for an
episode cut short before the environment closed it, its successful edits replayed on the start.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable

from composer_jax.agent.feedback import call_path
from composer_jax.agent.workflow import EpisodeOutcome
from composer_jax.envs.grading.task import Task
from composer_jax.envs.tasks.focus import Target, find_function, tab_shows_target, target_of

STAGES = ("found_file", "read_function", "body_parses", "visible_test", "hidden_tests", "report")
COMPLETE = "complete"
# visible(task, {path: text}) -> whether the visible test passes (None: the task has none)
VisibleTest = Callable[[Task, dict[str, str]], bool | None]


def final_text(task: Task, outcome: EpisodeOutcome, path: str) -> str | None:
    """The file at the end of the episode (None: it does not exist)."""
    change = outcome.trace.changes.get(path)
    if change is not None and change.get("after") is not None:
        return change["after"]
    text = task.files.get(path)
    for call in outcome.trace.tool_calls:
        if not call.ok or call_path(call) != path:
            continue
        if call.tool == "write_file":
            text = call.args.get("content", "")
        elif call.tool == "edit_file" and text is not None:
            text = text.replace(call.args.get("old", ""), call.args.get("new", ""), 1)
    return text


def _line(value: str | None, default: int) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        return default


def _read_function(outcome: EpisodeOutcome, target: Target, stub: ast.FunctionDef) -> bool:
    for call in outcome.trace.tool_calls:
        if call.ok and call.tool == "read_file" and call_path(call) == target.path:
            first = _line(call.args.get("start"), 1)
            last = _line(call.args.get("end"), 1 << 30)
            if first <= stub.end_lineno and last >= stub.lineno:
                return True
    return False


def episode_stages(
    task: Task, outcome: EpisodeOutcome, visible: VisibleTest, open_tab_lines: int = 0
) -> dict[str, bool]:
    """Whether the episode reached each stage (see the module's docstring), its environment's
    open tab showing `open_tab_lines`; the visible test runs only on a body that parses."""
    target = target_of(task)
    if target is None or outcome.trace is None:
        raise ValueError(f"{task.task_id}: no target function or no trace to check stages on")
    calls = [c for c in outcome.trace.tool_calls if c.ok]
    stub = find_function(task.files.get(target.path), target.name)
    text = final_text(task, outcome, target.path)
    written = find_function(text, target.name)
    parses = written is not None and (stub is None or ast.dump(written) != ast.dump(stub))
    grade = outcome.grade or {}
    return {
        "found_file": any(call_path(c) == target.path for c in calls),
        "read_function": (
            stub is None
            or tab_shows_target(task, open_tab_lines)
            or _read_function(outcome, target, stub)
        ),
        "body_parses": parses,
        "visible_test": parses and visible(task, {target.path: text}) is not False,
        "hidden_tests": (
            not outcome.flagged
            and grade.get("total", 0) > 0
            and grade.get("passed", 0) == grade.get("total")
        ),
        "report": bool(outcome.trace.final_message),
    }


def first_missed(stages: dict[str, bool]) -> str:
    return next((stage for stage in STAGES if not stages[stage]), COMPLETE)


def stage_breakdown(
    played: Iterable[tuple[Task, EpisodeOutcome]], visible: VisibleTest, open_tab_lines: int = 0
) -> dict[str, object]:
    """{"episodes", "unknown", "reached": {stage: n}, "failed_at": {stage or "complete": n}}
    over the episodes with a target function (played with `open_tab_lines` of open tab)."""
    reached = dict.fromkeys(STAGES, 0)
    failed_at = dict.fromkeys((*STAGES, COMPLETE), 0)
    episodes = unknown = 0
    for task, outcome in played:
        episodes += 1
        if target_of(task) is None or outcome.trace is None:
            unknown += 1
            continue
        stages = episode_stages(task, outcome, visible, open_tab_lines)
        for stage, met in stages.items():
            reached[stage] += met
        failed_at[first_missed(stages)] += 1
    return {"episodes": episodes, "unknown": unknown, "reached": reached, "failed_at": failed_at}


def format_stages(breakdown: dict) -> str:
    """The breakdown as a table: per stage, the share of episodes that reached it and how many
    stopped there first."""
    counted = breakdown["episodes"] - breakdown["unknown"]
    if not counted:
        return "stages: no episode of a task with a target function"
    lines = [f"{'stage':<14} {'reached':>16} {'failed here':>12}"]
    for stage in STAGES:
        got = breakdown["reached"][stage]
        share = f"{got}/{counted} ({got / counted:.0%})"
        lines.append(f"{stage:<14} {share:>16} {breakdown['failed_at'][stage]:>12}")
    done = breakdown["failed_at"][COMPLETE]
    lines.append(f"{COMPLETE:<14} {f'{done}/{counted} ({done / counted:.0%})':>16}")
    if breakdown["unknown"]:
        lines.append(f"({breakdown['unknown']} episodes of tasks without a target function)")
    return "\n".join(lines)
