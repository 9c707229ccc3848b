"""The tools room: the agent's tools, their registry and argument checks, and tool profiles.

`toolbox` (`TOOLS`, `@register_tool`, `ToolBox`, `check_args`, `TOOL_PROFILES`), `todo` (the
plan the `todo` tool keeps, restored from an episode's snapshot); `_code_search` is private (the
`search_code` tool's ranking).

Imports only `sandbox` (and itself) of `envs/`: never `grading`, `tasks` or the top-level modules.
"""

from composer_jax.envs.tools.toolbox import (
    DEFAULT_TOOLS,
    TOOL_PROFILES,
    TOOL_SPECS,
    TOOLS,
    Param,
    Tool,
    ToolBox,
    ToolCallRecord,
    ToolError,
    ToolSpec,
    check_args,
    describe_tools,
    register_tool,
    resolve_tool,
    run_tests_exit_codes,
    run_tests_outputs,
    tool_profile,
    unavailable_message,
)

__all__ = [
    "DEFAULT_TOOLS",
    "TOOLS",
    "TOOL_PROFILES",
    "TOOL_SPECS",
    "Param",
    "Tool",
    "ToolBox",
    "ToolCallRecord",
    "ToolError",
    "ToolSpec",
    "check_args",
    "describe_tools",
    "register_tool",
    "resolve_tool",
    "run_tests_exit_codes",
    "run_tests_outputs",
    "tool_profile",
    "unavailable_message",
]
