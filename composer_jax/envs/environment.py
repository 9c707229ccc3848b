"""The environment step API the actor loop drives: one `Episode` per rollout, many at once.

The loop submits a model turn and gets back the observation text to append, whether the episode is
done, the reward (at the end), the counts for the length penalty and the monitor flags. Steps of
different episodes run in parallel in `EpisodePool` (threads: the work is subprocesses and file
I/O, which release the GIL); steps of one episode are serialised by its lock.
"""

import concurrent.futures
import dataclasses
import functools
import random
import threading

from composer_jax.envs.grading import protocol, repo_grading
from composer_jax.envs.grading.monitors import MonitorFlag, RewardHackMonitor
from composer_jax.envs.grading.task import GRADING_LIMITS, GradeResult, Task, grade
from composer_jax.envs.sandbox.box import Sandbox, SandboxLimits, WorkspaceLimitError
from composer_jax.envs.tasks.focus import open_tab, tab_span
from composer_jax.envs.tools.todo import TodoList
from composer_jax.envs.tools.toolbox import (
    DEFAULT_TOOLS,
    TOOL_SPECS,
    ToolBox,
    ToolCallRecord,
    ToolError,
    describe_tools,
)

# Start-up and teardown time allowed per sandboxed command, on top of its own wall limit.
_COMMAND_SLACK_SECONDS = 5.0
# What a call cut off before its "</call>" (the turn ran out of tokens) gets instead of running.
CUT_OFF_CALL = "error: the call was cut off before </call>; it did not run. Write it whole."


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """One environment's settings: its tool set, argument strictness (training can be stricter
    than eval), turn and call caps, and sandbox limits for the agent's commands and for grading."""

    tools: tuple[str, ...] = DEFAULT_TOOLS
    strict_tools: bool = True
    max_turns: int = 8
    max_calls_per_turn: int = 8
    max_output_bytes: int = 2048
    limits: SandboxLimits = SandboxLimits(cpu_seconds=10, wall_seconds=20)
    grading_limits: SandboxLimits = GRADING_LIMITS
    backend: str = "auto"
    # Model-written code runs only in an isolating sandbox (bwrap or unshare); False allows the
    # unisolated rlimit fallback, for quick local experiments.
    require_isolation: bool = True
    workspace_root: str | None = None
    flagged_reward: float = 0.0  # the reward of an episode a reward-hack monitor flagged
    # The first observation shows up to this many lines of the target function, as an editor's
    # open tab would (`focus.open_tab`; 0: none).
    open_tab_lines: int = 0

    def step_seconds(self) -> float:
        """The longest one step can legitimately take: every call of a turn running a command to
        its wall limit, then grading to its own (plus start-up slack per command). An environment
        worker that takes longer is hung."""
        slack = _COMMAND_SLACK_SECONDS
        commands = self.max_calls_per_turn * (self.limits.wall_seconds + slack)
        return commands + self.grading_limits.wall_seconds + 2 * slack


SNAPSHOT_FORMAT = 2  # 2: the todo list
# A changed file's texts reach the end-of-episode record (`info["changes"]`) up to this size.
_MAX_CHANGE_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class StepResult:
    observation: str
    done: bool
    reward: float
    counts: dict[str, int]
    flags: tuple[MonitorFlag, ...]
    info: dict


class Episode:
    """One rollout on one task: its own sandbox, tools, monitor and counts."""

    def __init__(self, task: Task, config: EnvConfig = EnvConfig(), count_tokens=None):
        self.task = task
        self.config = config
        self.count_tokens = count_tokens or protocol.count_bytes
        self.sandbox = Sandbox.from_files(
            task.files,
            root=config.workspace_root,
            limits=config.limits,
            backend=config.backend,
            require_isolation=config.require_isolation,
            hidden_paths=task.hidden_paths,
        )
        self.tools = ToolBox(
            self.sandbox,
            config.tools,
            strict=config.strict_tools,
            test_command=task.visible_test_command,
            test_binds=repo_grading.test_binds() if task.grader["kind"] == "pytest" else None,
            max_output_bytes=config.max_output_bytes,
        )
        self.monitor = RewardHackMonitor(task)
        self.counts = protocol.EpisodeCounts()
        self.done = False
        self.reward = 0.0
        self.grade_result: GradeResult | None = None
        self._lock = threading.Lock()

    @property
    def prompt(self) -> str:
        """The first observation: the task, the open tab and the tools."""
        return episode_prompt(self.task, self.config)

    @property
    def call_log(self) -> list[ToolCallRecord]:
        return self.tools.log

    def step(self, model_output: str) -> StepResult:
        """Applies one agent turn. Never raises for anything the model wrote."""
        with self._lock:
            if self.done:
                return self._result("episode already finished", {})
            turn = protocol.parse_turn(model_output)
            self.counts.add_turn(turn, self.count_tokens)
            outputs = []
            first_call = len(self.tools.log)
            for call in turn.calls[: self.config.max_calls_per_turn]:
                if not call.complete:  # its arguments may be cut short: a write would be too
                    outputs.append(protocol.render_output(call.tool, CUT_OFF_CALL))
                    continue
                self.monitor.check_call(call, self.counts.turns)
                text, _ = self.tools.call(call.tool, call.args)
                outputs.append(protocol.render_output(call.tool, text))
            if len(turn.calls) > self.config.max_calls_per_turn:
                outputs.append(f"[only the first {self.config.max_calls_per_turn} calls ran]")
            if not turn.calls and turn.final is None:
                outputs.append(
                    "[no tool call or final message found: use <call tool=...> or <final>]"
                )
            observation = "\n".join(outputs)
            self.counts.tool_output_tokens += self.count_tokens(observation)
            info = {"parse_errors": list(turn.errors), "calls": self.tools.log[first_call:]}
            if turn.final is not None or self.counts.turns >= self.config.max_turns:
                info["changes"] = self._finish()
                info["grade"] = dataclasses.asdict(self.grade_result)
                info["todo"] = self.tools.todo.as_json()
            elif tab := self._edited_tab():
                info["open_tab"] = tab
            return self._result(observation, info)

    @functools.cached_property
    def _first_tab(self) -> tuple[tuple[str, int, int] | None, str]:
        """(span, text) of the first observation's open tab (fixed for the episode)."""
        lines = self.config.open_tab_lines
        return tab_span(self.task, lines), open_tab(self.task, lines)

    def _edited_tab(self) -> str:
        """The open tab as the workspace holds the target's file now, when that differs from
        the first observation's ("" otherwise, or when the file cannot be read as the tools
        would read it): what a restarted generation is shown."""
        span, first = self._first_tab
        if span is None:
            return ""
        try:
            path = self.tools.resolve(span[0])  # never a link out of the workspace
            if not path.is_file():  # deleted, or not a regular file (a FIFO would block)
                return ""
            text = path.read_text(encoding="utf-8", errors="replace")
        except (ToolError, OSError):
            return ""
        if text == self.task.files.get(span[0]):  # unedited: nothing to parse
            return ""
        tab = open_tab(self.task, self.config.open_tab_lines, {span[0]: text})
        return "" if tab == first else tab

    def snapshot(self) -> dict:
        """The state between two turns (workspace files, counts, call log, monitor flags), to
        resume the episode elsewhere with `restore`; plain picklable data. A finished episode has
        nothing to resume."""
        with self._lock:
            if self.done:
                raise RuntimeError("a finished episode cannot be snapshotted")
            return {
                "format": SNAPSHOT_FORMAT,
                "task_id": self.task.task_id,
                "files": self.sandbox.snapshot(),
                "counts": self.counts.as_dict(),
                "calls": [dataclasses.asdict(record) for record in self.tools.log],
                "flags": [dataclasses.asdict(flag) for flag in self.monitor.flags],
                "todo": self.tools.todo.as_json(),
            }

    def restore(self, snapshot: dict) -> None:
        """Puts this fresh episode of the same task in the state `snapshot` recorded."""
        if not isinstance(snapshot, dict) or snapshot.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"not an episode snapshot (format {SNAPSHOT_FORMAT} expected)")
        if snapshot.get("task_id") != self.task.task_id:
            raise ValueError(
                f"snapshot of task {snapshot.get('task_id')!r} given to {self.task.task_id!r}"
            )
        with self._lock:
            if self.counts.turns or self.done:
                raise RuntimeError("only a fresh episode can be restored")
            try:
                counts = protocol.EpisodeCounts(**snapshot["counts"])
                calls = [ToolCallRecord(**record) for record in snapshot["calls"]]
                flags = [MonitorFlag(**flag) for flag in snapshot["flags"]]
                files = dict(snapshot["files"])
                todo = TodoList.from_json(snapshot["todo"])
            except (KeyError, TypeError) as error:
                raise ValueError(f"malformed episode snapshot: {error!r}") from None
            self.sandbox.restore(files)
            self.counts, self.tools.log, self.monitor.flags = counts, calls, flags
            self.tools.todo = todo

    def _finish(self) -> dict[str, dict]:
        """Grades the workspace; returns the files the episode changed (`changed_files`)."""
        self.done = True
        try:
            files = self.sandbox.snapshot()
        except WorkspaceLimitError as error:  # the sandbox trims after every command
            files = {}
            self.monitor.flag("resource_abuse", str(error), self.counts.turns)
        self.monitor.check_workspace(files, self.counts.turns)
        self.grade_result = grade(self.sandbox, self.task, self.config.grading_limits)
        self.monitor.check_grading(self.grade_result.scores, self.counts.turns)
        flagged = self.config.flagged_reward
        self.reward = flagged if self.monitor.flags else self.grade_result.reward
        return changed_files(self.task.files, files)

    def _result(self, observation: str, info: dict) -> StepResult:
        return StepResult(
            observation=observation,
            done=self.done,
            reward=self.reward if self.done else 0.0,
            counts=self.counts.as_dict(),
            flags=tuple(self.monitor.flags),
            info=info,
        )

    def close(self) -> None:
        self.sandbox.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class EpisodePool:
    """Runs episode steps concurrently; `submit` returns a future of the StepResult."""

    def __init__(self, max_workers: int = 8):
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="episode"
        )

    def start(self, task: Task, config: EnvConfig = EnvConfig()) -> "concurrent.futures.Future":
        """A future of a fresh Episode (creating the workspace is I/O too)."""
        return self._executor.submit(Episode, task, config)

    def submit(self, episode: Episode, model_output: str) -> "concurrent.futures.Future":
        return self._executor.submit(episode.step, model_output)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def changed_files(original: dict[str, str], final: dict[str, bytes]) -> dict[str, dict]:
    """{path: {"before": text or None, "after": text or None}} of every file the episode
    created, changed or deleted (texts over _MAX_CHANGE_BYTES, or not UTF-8, as None): what a
    behaviour reward reads as the episode's diff."""

    def text(data: bytes | None) -> str | None:
        if data is None or len(data) > _MAX_CHANGE_BYTES:
            return None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return None

    changes = {}
    for path in sorted(set(original) | set(final)):
        before = original.get(path)
        before_bytes = None if before is None else before.encode("utf-8", "surrogateescape")
        if before_bytes != final.get(path):
            changes[path] = {"before": text(before_bytes), "after": text(final.get(path))}
    return changes


def episode_prompt(task: Task, config: EnvConfig = EnvConfig()) -> str:
    """An episode's first observation (the task, the open tab, the tools), without making an
    episode."""
    return f"{task.prompt}{open_tab(task, config.open_tab_lines)}{describe_tools(config.tools)}\n"


def sft_example(task: Task, config: EnvConfig = EnvConfig()) -> tuple[str, str]:
    """(first observation, the oracle's first turn): a supervised example of the agent's turn."""
    return episode_prompt(task, config), oracle_turns(task)[0]


def oracle_turns(task: Task) -> list[str]:
    """A scripted agent that writes the solution files, then finishes (SFT data, oracle test)."""
    calls = tuple(("write_file", {"path": p, "content": c}) for p, c in task.oracle_files.items())
    return [protocol.render_turn(calls=calls), protocol.render_turn(final="Done.")]


def random_turns(task: Task, rng: random.Random, num_turns: int = 2) -> list[str]:
    """A random policy: random tool calls with random text, then a final message."""
    alphabet = "abcdefxyz()[]:=+-*/ \n'\"0123456789<>"
    turns = []
    for _ in range(num_turns):
        tool = rng.choice(sorted(TOOL_SPECS))
        args = {
            name: "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
            for name in TOOL_SPECS[tool].params
        }
        if "path" in args and rng.random() < 0.7:
            args["path"] = rng.choice(sorted(task.files))
        noise = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        try:
            turns.append(noise + protocol.render_call(tool, args))
        except ValueError:
            turns.append(noise)
    turns.append(protocol.render_turn(final="done"))
    return turns


def run_episode(task: Task, turns: list[str], config: EnvConfig = EnvConfig()) -> StepResult:
    """Plays scripted turns to the end; returns the last step's result."""
    with Episode(task, config) as episode:
        result = None
        for text in turns:
            result = episode.step(text)
            if result.done:
                break
        return result
