"""Behaviour rewards (the report's s4.2): one registry of functions of what an episode did.

Each reward is a function `(behaviour, context) -> float` in [-1, 0], registered by name with
`@behaviour_reward("name")`, or named by import path (`my_pkg.rewards:polite`). A run chooses them
with their weights, `rl.agent.behaviour_rewards = ("todo_unfinished=0.05", "my_pkg.rewards:polite=0.1")`:
the workflow computes every chosen reward when an episode ends, the ledger keeps each value, the
trainer adds `weight * value` to the sample's total reward (beside the task reward and minus the
length penalty) and logs it as `reward/<name>`. Adding one is one function and one config line.

The communication reward asks a judge (`context.judge`, `rl.agent.communication_judge`): a function of
the episode's behaviour returning a score in [0, 1]. The built-in one is a rubric; a model judge
is a function with the same signature named by import path. Judges run on the rollout thread
when an episode ends, so a slow one slows rollouts.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Callable

from composer_jax import plugins
from composer_jax.agent import style
from composer_jax.envs.tools import ToolCallRecord


@dataclasses.dataclass(frozen=True)
class EpisodeBehaviour:
    """What a finished episode did, as far as the behaviour rewards care."""

    turns: int = 0
    tool_calls: tuple[ToolCallRecord, ...] = ()  # every call, in order
    feedback: dict = dataclasses.field(default_factory=dict)  # detector -> turns flagged
    final_message: str | None = None  # the last turn's final message; None: ran out of turns
    todo: tuple[dict, ...] = ()  # the plan at the end: {"text", "done"} items
    changes: dict = dataclasses.field(default_factory=dict)  # path -> {"before", "after"} texts
    flagged: bool = False  # a reward-hack monitor flagged it
    summaries: int = 0

    @property
    def test_runs(self) -> list[ToolCallRecord]:
        """The calls that ran the tests: run_tests, or a shell command that runs a test runner."""
        return [
            call
            for call in self.tool_calls
            if call.tool == "run_tests"
            or (call.tool == "run_shell" and _TEST_COMMAND.search(call.args.get("command", "")))
        ]

    @property
    def tests_run(self) -> bool:
        return bool(self.test_runs)

    @property
    def last_tests_failed(self) -> bool:
        """The last test run that finished reported a failure (a non-zero exit code)."""
        codes = [call.exit_code for call in self.test_runs if call.exit_code is not None]
        return bool(codes) and codes[-1] != 0


Judge = Callable[[EpisodeBehaviour], float]


@dataclasses.dataclass(frozen=True)
class RewardContext:
    judge: Judge  # the communication judge: behaviour -> score in [0, 1]


RewardFn = Callable[[EpisodeBehaviour, RewardContext], float]
BEHAVIOUR_REWARDS: dict[str, RewardFn] = {}
# Feedback detectors whose turns count as tool misuse.
TOOL_MISUSE_DETECTORS = (
    "unknown_tool",
    "tool_unavailable",
    "invalid_arguments",
    "ignored_tool_error",
)


def behaviour_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def register(fn: RewardFn) -> RewardFn:
        BEHAVIOUR_REWARDS[name] = fn
        return fn

    return register


@behaviour_reward("todo_unfinished")
def todo_unfinished(behaviour: EpisodeBehaviour, context: RewardContext) -> float:
    """Minus the share of the plan's items left open at the end (0 without a plan)."""
    if not behaviour.todo:
        return 0.0
    return -sum(not item["done"] for item in behaviour.todo) / len(behaviour.todo)


@behaviour_reward("tool_errors")
def tool_errors(behaviour: EpisodeBehaviour, context: RewardContext) -> float:
    """Minus the share of tool calls that failed (bad arguments, missing files, unavailable)."""
    calls = behaviour.tool_calls
    return -sum(not call.ok for call in calls) / len(calls) if calls else 0.0


@behaviour_reward("tool_misuse")
def tool_misuse(behaviour: EpisodeBehaviour, context: RewardContext) -> float:
    """Minus the share of tool calls (at least one) in turns the misuse detectors flagged."""
    misuse = sum(behaviour.feedback.get(name, 0) for name in TOOL_MISUSE_DETECTORS)
    return -min(1.0, misuse / max(len(behaviour.tool_calls), 1))


@behaviour_reward("style")
def diff_style(behaviour: EpisodeBehaviour, context: RewardContext) -> float:
    """Minus the share of the Python lines the episode added that the style monitor flags
    (`agent.style`: commented-out code, long comments, long lines, tabs; all of a file that
    does not parse)."""
    issues, added = style.diff_issues(behaviour.changes)
    flagged = {(issue.path, issue.line) for issue in issues}
    return -min(1.0, len(flagged) / added) if added else 0.0


@behaviour_reward("answered")
def answered(behaviour: EpisodeBehaviour, context: RewardContext) -> float:
    """-1 when the episode ended without a final message (it ran out of turns)."""
    return 0.0 if behaviour.final_message is not None else -1.0


@behaviour_reward("communication")
def communication(behaviour: EpisodeBehaviour, context: RewardContext) -> float:
    """The judge's score of the final message, minus 1."""
    return min(max(float(context.judge(behaviour)), 0.0), 1.0) - 1.0


@behaviour_reward("harm")
def harm(behaviour: EpisodeBehaviour, context: RewardContext) -> float:
    """-1 when a reward-hack monitor flagged the episode (its task reward is already 0)."""
    return -1.0 if behaviour.flagged else 0.0


_TESTED = re.compile(r"\b(test|tests|tested|testing|pytest|passe[sd]|pass|fail(s|ed)?)\b", re.I)
_PASSING = re.compile(r"\b(pass|passes|passed|passing|green)\b", re.I)
_NEGATED = re.compile(r"\b(not|never|no longer|yet to)\b|n't\b", re.I)
# A shell command that runs tests: a test runner, or Python on a test file or module.
_TEST_COMMAND = re.compile(r"\b(pytest|unittest)\b|\bpython[\d.]*(\s+-\w+)*\s+tests?[\w./]*")


def _claims_passing(message: str) -> bool:
    """A sentence (or clause) of the message says tests pass, without a negation."""
    parts = re.split(r"[.;:!?\n]+", message)
    return any(_PASSING.search(part) and not _NEGATED.search(part) for part in parts)


_UNTESTED = re.compile(r"\b(not|un|never|could ?n[o']t|did ?n[o']t)[ -]?test", re.I)


def rubric_judge(behaviour: EpisodeBehaviour) -> float:
    """The built-in communication rubric, in [0, 1]: half for saying what changed (the final
    message names a changed file or a function the diff touches), half for saying how it was
    tested truthfully (it mentions tests and the episode ran them, and does not say they pass
    when its last run failed; or it says it did not test and none ran). No final message
    scores 0."""
    message = behaviour.final_message
    if not message:
        return 0.0
    named = set()
    for path in behaviour.changes:
        named |= {path, path.rsplit("/", 1)[-1]}
    named |= changed_functions(behaviour.changes)
    what = any(re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", message) for name in named)
    if _UNTESTED.search(message):
        how = not behaviour.tests_run
    else:
        how = bool(_TESTED.search(message)) and behaviour.tests_run
        if behaviour.last_tests_failed and _claims_passing(message):
            how = False  # "they pass" when the last run failed
    return 0.5 * what + 0.5 * how


def changed_functions(changes: dict[str, dict]) -> set[str]:
    """Names of the functions and classes whose lines the episode changed in Python files."""
    names = set()
    for path, change in changes.items():
        after = change.get("after")
        if not path.endswith(".py") or after is None:
            continue
        added = style.added_lines(change.get("before"), after)
        try:
            tree = ast.parse(after)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if added & set(range(node.lineno, (node.end_lineno or node.lineno) + 1)):
                    names.add(node.name)
    return names


JUDGES: dict[str, Judge] = {"rubric": rubric_judge}


def resolve_reward(name: str) -> RewardFn:
    return plugins.resolve(BEHAVIOUR_REWARDS, name, "behaviour reward")


def resolve_judge(name: str) -> Judge:
    return plugins.resolve(JUDGES, name, "judge")


def reward_weights(specs: tuple[str, ...]) -> dict[str, float]:
    """{name: weight} of `rl.agent.behaviour_rewards` items "name=weight" (checked: a known reward,
    a number, each name once); a ValueError says what is wrong with every bad item."""
    weights, problems = {}, []
    for item in specs:
        name, sep, number = (part.strip() for part in item.rpartition("="))
        try:
            weight = float(number) if sep and name else None
        except ValueError:
            weight = None
        if weight is None:
            problems.append(f"{item!r} is not name=weight")
            continue
        try:
            resolve_reward(name)
        except ValueError as error:
            problems.append(str(error))
            continue
        if name in weights:
            problems.append(f"{name} is given twice")
        weights[name] = weight
    if problems:
        raise ValueError("; ".join(problems))
    return weights


class BehaviourRewards:
    """The run's rewards and judge, resolved once: `values(behaviour)` -> {name: value}."""

    def __init__(self, specs: tuple[str, ...], judge: str = "rubric"):
        self.weights = reward_weights(specs)
        self.functions = {name: resolve_reward(name) for name in self.weights}
        self.context = RewardContext(judge=resolve_judge(judge))

    def values(self, behaviour: EpisodeBehaviour) -> dict[str, float]:
        out = {}
        for name, fn in self.functions.items():
            value = float(fn(behaviour, self.context))
            if not -1.0 <= value <= 0.0:
                raise ValueError(f"behaviour reward {name} gave {value}, outside [-1, 0]")
            out[name] = value
        return out
