"""A researcher's own task source, loaded by import path in test_sources.py (not a test)."""

from composer_jax import envs
from composer_jax.envs.grading.task import case_tests, encode_value


def make_source(count: str = "3"):
    """Tasks of one fixed function, each with its own cases."""
    tasks = []
    for i in range(int(count)):
        cases = [[[encode_value(v)], encode_value(v * (i + 2))] for v in range(3)]
        tasks.append(
            envs.Task(
                task_id=f"plugin-{i}",
                prompt=f"Write f(x) in solution.py returning x times {i + 2}.\n",
                files={"solution.py": "def f(x):\n    raise NotImplementedError\n"},
                grader={"kind": "cases", "module": "solution", "function": "f", "cases": cases},
                graded_tests=case_tests(3),
                oracle_files={"solution.py": f"def f(x):\n    return x * {i + 2}\n"},
            )
        )
    return tasks
