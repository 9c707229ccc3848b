"""The tasks room: where tasks come from and how new ones are made.

`task_source` (`TaskSource`, `ListSource`), `sources` (`load_task_source(spec)`, the named
families and mixtures), the families `builtin_tasks`, `builtin_repo`, `humaneval`,
`state_tracking`, `jsonl_tasks`, repository tasks (`repo_factory` makes them, `repo_task_sets`
reads and writes set files; the shipped sets are `data/repositories/`; `test_literals`, what
their graded tests hard-code), `focus` (a task's target
function and the editor's open tab). Private: `_deletion` (the function bodies `repo_factory`
deletes).

Imports `grading` and `sandbox` (and itself) of `envs/`: never `tools` or the top-level modules.
The names are re-exported by `composer_jax.envs` (e.g. `load_task_source`, `builtin_tasks`).
"""
