"""Feature deletion from the stdlib: verified tasks, oracle scores 1, copying the original from
the system path is flagged (and, under bwrap, finds nothing), the cache works. The >= 50 task run
is marked slow."""

import os
import time

import pytest

from composer_jax.envs.environment import Episode, oracle_turns, run_episode
from composer_jax.envs.feature_deletion import (
    CACHE_FORMAT,
    _deletable_functions,
    delete_body,
    synthesize_stdlib_tasks,
)
from composer_jax.envs.protocol import render_turn
from composer_jax.envs.sandbox import bwrap_available


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fd_cache")


@pytest.fixture(scope="module")
def tasks(cache_dir):
    return synthesize_stdlib_tasks(3, seed=0, cache_dir=cache_dir, time_budget_s=120)


def test_delete_body_keeps_signature_and_docstring():
    source = 'class A:\n    def f(self, x):\n        """Doc."""\n        y = x\n        return y\n'
    [(name, first, last, indent)] = _deletable_functions(source, "f(")
    deleted = delete_body(source, first, last, indent)
    assert name == "A.f"
    assert (
        deleted == 'class A:\n    def f(self, x):\n        """Doc."""\n'
        "        raise NotImplementedError\n"
    )


def test_tasks_are_verified_and_cached(tasks, cache_dir):
    assert len(tasks) == 3
    for task in tasks:
        assert task.graded_tests and "raise NotImplementedError" in next(iter(task.files.values()))
    start = time.monotonic()
    again = synthesize_stdlib_tasks(3, seed=0, cache_dir=cache_dir)
    assert again == tasks and time.monotonic() - start < 1.0


def test_oracle_scores_one(tasks):
    for task in tasks:
        result = run_episode(task, oracle_turns(task))
        assert result.reward == 1.0 and result.flags == (), result.info


def test_copying_the_original_is_flagged(tasks):
    task = tasks[0]
    module = next(iter(task.files))
    original = task.grading_hidden_paths[0]
    copy = render_turn(calls=(("run_shell", {"command": f"cp {original} {module}"}),))
    result = run_episode(task, [copy, render_turn(final="done")])
    assert result.reward == 0.0
    assert "hidden_path" in {flag.kind for flag in result.flags}


@pytest.mark.skipif(not bwrap_available(), reason="masking needs bwrap")
def test_original_bytecode_tests_and_cache_are_unreachable(tasks, cache_dir):
    task = tasks[0]
    with Episode(task) as episode:
        for path in task.hidden_paths:
            assert episode.sandbox.run(f"wc -c < {path}").output.strip() == "0", path
        listing = episode.sandbox.run(f"ls {cache_dir}; ls ~/.cache/composer_jax")
        assert "seed0.json" not in listing.output and listing.returncode != 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fifty_tasks_in_a_few_minutes(tmp_path):
    start = time.monotonic()
    tasks = synthesize_stdlib_tasks(50, seed=0, cache_dir=tmp_path, time_budget_s=600)
    elapsed = time.monotonic() - start
    print(f"feature deletion: {len(tasks)} tasks in {elapsed:.0f}s")
    assert len(tasks) >= 50 and elapsed < 300
    assert len({t.task_id for t in tasks}) == len(tasks)
    rewards = {t.task_id: run_episode(t, oracle_turns(t)) for t in tasks}
    assert {k: r.reward for k, r in rewards.items() if r.reward != 1.0 or r.flags} == {}
    assert os.path.exists(tmp_path / f"stdlib-v{CACHE_FORMAT}-seed0.json")
