"""The built-in family: oracle scores 1, random scores ~0, deterministic per seed, splits."""

import random

import pytest

from composer_jax.data import ByteTokenizer
from composer_jax.envs.environment import (
    EnvConfig,
    Episode,
    oracle_turns,
    random_turns,
    run_episode,
)
from composer_jax.envs.tasks.builtin_tasks import builtin_tasks, make_task


def test_generation_is_deterministic_and_short():
    assert builtin_tasks(20, seed=3) == builtin_tasks(20, seed=3)
    assert builtin_tasks(5, seed=3) != builtin_tasks(5, seed=4)
    for task in builtin_tasks(50):
        assert len(task.prompt) < 300 and len(task.oracle_files["solution.py"]) < 300


def test_thousands_of_distinct_functions_and_disjoint_splits():
    train = {make_task(seed).oracle_files["solution.py"] for seed in range(4000)}
    assert len(train) > 1000
    held_out = builtin_tasks(30, split="held_out")
    train_sources = {t.oracle_files["solution.py"] for t in builtin_tasks(300)}
    assert all(t.split == "held_out" for t in held_out)
    assert not train_sources & {t.oracle_files["solution.py"] for t in held_out}


def test_oracle_scores_one_and_random_scores_about_zero():
    tasks = builtin_tasks(12) + builtin_tasks(4, split="held_out")
    oracle = [run_episode(task, oracle_turns(task)) for task in tasks]
    assert all(r.done and r.reward == 1.0 and not r.flags for r in oracle)
    rng = random.Random(0)
    rewards = [run_episode(task, random_turns(task, rng)).reward for task in tasks]
    assert sum(rewards) / len(rewards) < 0.1


def test_oracle_turns_round_trip_through_the_tokenizer():
    tokenizer = ByteTokenizer()
    for turn in oracle_turns(make_task(7)):
        assert tokenizer.decode(tokenizer.encode(turn)) == turn


def test_episode_counts_and_observations():
    task = make_task(11)
    with Episode(task) as episode:
        assert task.prompt in episode.prompt and "write_file(path, content)" in episode.prompt
        first = episode.step(
            "<think>let me look</think>" + '<call tool="read_file">'
            '<arg name="path">solution.py</arg></call>'
        )
        assert not first.done and "NotImplementedError" in first.observation
        nothing = episode.step("hmm")
        assert "no tool call" in nothing.observation
        last = episode.step("<final>giving up</final>")
    assert last.done and last.reward == 0.0
    counts = last.counts
    assert counts["turns"] == 3 and counts["tool_calls"] == 1
    assert counts["thinking_tokens"] == len("<think>let me look</think>") + len("hmm")
    assert counts["final_tokens"] == len("<final>giving up</final>")
    assert counts["tool_output_tokens"] > 0 and counts["tool_call_tokens"] > 0


def test_max_turns_ends_the_episode():
    with Episode(make_task(1), EnvConfig(max_turns=2)) as episode:
        assert not episode.step("a").done
        assert episode.step("b").done


def test_snapshot_resumes_an_episode_between_turns():
    """A snapshot after the oracle's write carries the workspace, counts and call log: a fresh
    episode restored from it finishes with reward 1 on the final turn alone (an unrestored one
    scores 0 on that turn)."""
    task = make_task(12)
    write, final = oracle_turns(task)
    with Episode(task) as original:
        first = original.step(write)
        snapshot = original.snapshot()
        reference = original.step(final)
    assert not first.done and reference.done and reference.reward == 1.0
    with Episode(task) as resumed:
        resumed.restore(snapshot)
        assert len(resumed.call_log) == 1 and resumed.call_log[0].tool == "write_file"
        result = resumed.step(final)
    assert result.done and result.reward == 1.0 and result.counts == reference.counts
    with Episode(task) as fresh:
        assert fresh.step(final).reward == 0.0


def test_snapshot_errors_are_clear():
    task, other = make_task(12), make_task(13)
    with Episode(task) as episode:
        snapshot = episode.snapshot()
        with Episode(other) as wrong_task, pytest.raises(ValueError, match="snapshot of task"):
            wrong_task.restore(snapshot)
        with Episode(task) as target, pytest.raises(ValueError, match="not an episode snapshot"):
            target.restore({"format": 99})
        with Episode(task) as target, pytest.raises(ValueError, match="malformed"):
            target.restore({**snapshot, "counts": {"bogus": 1}})
        with Episode(task) as used, pytest.raises(RuntimeError, match="fresh"):
            used.step("hmm")
            used.restore(snapshot)
        episode.step("<final>done</final>")
        with pytest.raises(RuntimeError, match="finished"):
            episode.snapshot()
