"""Sandboxed coding environments with test-based rewards (no JAX: runs on CPU-only hosts)."""

from composer_jax.envs.builtin_tasks import builtin_tasks, make_task, solution_source
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
from composer_jax.envs.feature_deletion import (
    candidate_modules,
    default_cache_dir,
    synthesize_package_tasks,
    synthesize_stdlib_tasks,
)
from composer_jax.envs.humaneval import humaneval_tasks
from composer_jax.envs.jsonl_tasks import JsonlTaskError, load_jsonl_tasks
from composer_jax.envs.monitors import MonitorFlag, RewardHackMonitor
from composer_jax.envs.protocol import (
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
from composer_jax.envs.sources import (
    SOURCES,
    ListSource,
    MixtureSource,
    TaskSource,
    TaskSourceError,
    load_task_source,
)
from composer_jax.envs.task import GradeResult, Task, TaskError, grade, grade_solution
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
    "ToolBox",
    "ToolCall",
    "ToolCallRecord",
    "ToolSpec",
    "Turn",
    "WorkspaceLimitError",
    "builtin_tasks",
    "bwrap_available",
    "candidate_modules",
    "check_args",
    "count_bytes",
    "default_cache_dir",
    "grade",
    "grade_solution",
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
    "synthesize_package_tasks",
    "synthesize_stdlib_tasks",
]
