"""pass@k and best-of-K against brute-force enumeration of all k-subsets; report shape."""

import itertools
import json
import math
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


def test_best_of_k_over_thousands_of_samples_stays_finite():
    """2,000 samples, k = 1,000: comb(n, k) is far past a float's range (an OverflowError from
    about n = 1,030); binary rewards still give pass@k, graded ones a mean between min and max."""
    rewards = [1.0] * 300 + [0.0] * 1700
    assert best_of_k(rewards, 1000) == pytest.approx(pass_at_k(2000, 300, 1000), abs=1e-12)
    graded = [i / 1999 for i in range(2000)]
    assert 0.99 < best_of_k(graded, 1000) <= 1.0


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


def test_mean_interval_is_students_t_over_tasks():
    from composer_jax.eval.passk import mean_interval

    mean, half = mean_interval([1.0, 2.0, 3.0, 4.0])
    # t(0.975, 3) = 3.18245; sample sd of 1..4 = 1.29099; n = 4
    assert mean == 2.5 and half == pytest.approx(3.18245 * 1.29099 / 2, rel=1e-4)
    assert math.isnan(mean_interval([0.5])[1])


def test_report_groups_and_scores():
    records = [
        EpisodeRecord("a", 1.0, 10, 0, scores={"similarity": 1.0}, group="history_length=1"),
        EpisodeRecord("a", 0.0, 12, 0, scores={"similarity": 0.5}, group="history_length=1"),
        EpisodeRecord(
            "b", 0.0, 30, 1, turns=2, scores={"similarity": 0.25}, group="history_length=8"
        ),
    ]
    report = evaluate(records, ks=(1, 2))
    assert report["per_task"]["a"]["mean_similarity"] == 0.75
    assert report["by_group"]["history_length=1"]["pass@1"] == 0.5
    assert report["by_group"]["history_length=8"]["mean_similarity"] == 0.25
    assert report["summary"]["mean_turns"] == 1.0  # task a: 0 turns, task b: 2
    assert "history_length=8" in format_table(report)
