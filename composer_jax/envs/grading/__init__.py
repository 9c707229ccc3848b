"""The grading room: what a task is and how an episode is judged.

`task` (`Task`, `grade`, `grade_solution`: the harness run in a fresh sandbox command),
`harness` (the grader inside the sandbox), `repo_grading` (grading trees of repository tasks),
`replay` (recorded calls replayed on the candidate, compared outside its process), `monitors`
(reward-hack monitors over an episode's calls and final workspace), `protocol` (the episode's
turn text: calls, outputs, counts, which the monitors read). Private: `_repo_runner` (the
guarded pytest runner `repo_grading` ships into the sandbox), `_code_monitor` (the AST monitors
`monitors` applies to the diff).

Imports only `sandbox` (and itself) of `envs/`: never `tools`, `tasks` or the top-level modules.
"""

from composer_jax.envs.grading.monitors import MonitorFlag, RewardHackMonitor
from composer_jax.envs.grading.task import (
    GRADING_LIMITS,
    GradeResult,
    Task,
    TaskError,
    grade,
    grade_solution,
    replay_solution,
    visible_test_passes,
)

__all__ = [
    "GRADING_LIMITS",
    "GradeResult",
    "MonitorFlag",
    "RewardHackMonitor",
    "Task",
    "TaskError",
    "grade",
    "grade_solution",
    "replay_solution",
    "visible_test_passes",
]
