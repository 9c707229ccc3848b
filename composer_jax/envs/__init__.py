"""Sandboxed coding environments with test-based rewards (no JAX: runs on CPU-only hosts).

Four rooms import one way: `tasks` -> `grading` -> `sandbox`, `tools` -> `sandbox`
(`tests/test_layering.py`). This top level composes them (`environment`: the episode; `worker`: the
environment worker process) and re-exports their public names; no room imports it.
"""

from composer_jax.envs.environment import (
    DEFAULT_TOOLS,
    EnvConfig,
    Episode,
    EpisodePool,
    StepResult,
    episode_prompt,
    oracle_turns,
    random_turns,
    run_episode,
    sft_example,
)
from composer_jax.envs.grading import (
    GradeResult,
    MonitorFlag,
    RewardHackMonitor,
    Task,
    TaskError,
    grade,
    grade_solution,
    visible_test_passes,
)
from composer_jax.envs.grading.protocol import (
    EpisodeCounts,
    ToolCall,
    Turn,
    count_bytes,
    parse_turn,
    render_call,
    render_output,
    render_turn,
)
from composer_jax.envs.sandbox import (
    CommandResult,
    IsolationUnavailable,
    Sandbox,
    SandboxLimits,
    WorkspaceLimitError,
    bwrap_available,
    python_executable,
)
from composer_jax.envs.tasks.builtin_tasks import builtin_tasks, make_task, solution_source
from composer_jax.envs.tasks.humaneval import humaneval_tasks
from composer_jax.envs.tasks.jsonl_tasks import JsonlTaskError, load_jsonl_tasks
from composer_jax.envs.tasks.sources import (
    SOURCES,
    ListSource,
    MixtureSource,
    TaskSource,
    TaskSourceError,
    drawn_tasks,
    load_task_source,
    task_source,
)
from composer_jax.envs.tools import TOOL_SPECS, ToolBox, ToolCallRecord, ToolSpec, check_args

__all__ = [
    "DEFAULT_TOOLS",
    "SOURCES",
    "TOOL_SPECS",
    "CommandResult",
    "EnvConfig",
    "Episode",
    "EpisodeCounts",
    "EpisodePool",
    "GradeResult",
    "IsolationUnavailable",
    "JsonlTaskError",
    "ListSource",
    "MixtureSource",
    "MonitorFlag",
    "RewardHackMonitor",
    "Sandbox",
    "SandboxLimits",
    "StepResult",
    "Task",
    "TaskError",
    "TaskSource",
    "TaskSourceError",
    "drawn_tasks",
    "task_source",
    "ToolBox",
    "ToolCall",
    "ToolCallRecord",
    "ToolSpec",
    "Turn",
    "WorkspaceLimitError",
    "builtin_tasks",
    "bwrap_available",
    "check_args",
    "count_bytes",
    "grade",
    "grade_solution",
    "visible_test_passes",
    "humaneval_tasks",
    "load_jsonl_tasks",
    "load_task_source",
    "make_task",
    "episode_prompt",
    "oracle_turns",
    "sft_example",
    "parse_turn",
    "python_executable",
    "random_turns",
    "render_call",
    "render_output",
    "render_turn",
    "run_episode",
    "solution_source",
]
