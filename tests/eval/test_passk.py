"""pass@k and best-of-K against brute-force enumeration of all k-subsets; report shape."""

import itertools
import json
import random
from math import comb

import pytest

from composer_jax.eval.passk import (
    EpisodeRecord,
    best_of_k,
    evaluate,
    format_table,
    pass_at_k,
    write_report,
)


def _subsets(values, k):
    return list(itertools.combinations(values, k))


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = _subsets(outcomes, k)
            brute = sum(max(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_best_of_k_matches_enumeration():
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(1, 8)
        rewards = [rng.choice([0.0, 0.25, 0.5, 1.0, rng.random()]) for _ in range(n)]
        for k in range(1, n + 1):
            subsets = _subsets(rewards, k)
            assert len(subsets) == comb(n, k)
            brute = sum(max(s) for s in subsets) / len(subsets)
            assert best_of_k(rewards, k) == pytest.approx(brute, abs=1e-12)


def test_best_of_k_on_binary_rewards_is_pass_at_k():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0]
    for k in range(1, 6):
        assert best_of_k(rewards, k) == pytest.approx(pass_at_k(5, 2, k))


def test_invalid_arguments():
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        best_of_k([1.0], 2)


def test_report(tmp_path):
    records = [
        EpisodeRecord("a", 1.0, 100, 2),
        EpisodeRecord("a", 0.0, 50, 1),
        EpisodeRecord("b", 0.5, 10, 0, flagged=True),
        EpisodeRecord("b", 0.0, 30, 4),
    ]
    report = evaluate(records, ks=(1, 2))
    summary = report["summary"]
    assert summary["tasks"] == 2 and summary["episodes"] == 4
    assert summary["pass@1"] == pytest.approx(0.25) and summary["pass@2"] == pytest.approx(0.5)
    assert summary["best_of_2"] == pytest.approx(0.75)
    assert summary["mean_reward"] == pytest.approx(0.375)
    assert summary["mean_tokens"] == pytest.approx(47.5)
    assert summary["mean_tool_calls"] == pytest.approx(1.75)
    assert summary["flag_rate"] == pytest.approx(0.25)
    assert "pass@5" not in summary
    table = format_table(report)
    assert "pass@2" in table and "0.5000" in table
    write_report(report, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["per_task"]["a"]["samples"] == 2
