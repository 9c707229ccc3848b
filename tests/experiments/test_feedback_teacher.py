"""experiments/feedback_teacher.py: the per-turn measures against numpy and the paired summary."""

import numpy as np
import pytest

from experiments import feedback_teacher


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_turn_measures_match_numpy(fresh_rng):
    student = _log_softmax(fresh_rng.normal(size=(6, 11)))
    teacher = _log_softmax(fresh_rng.normal(size=(6, 11)))
    tokens = fresh_rng.integers(0, 11, 6)
    kl, change = feedback_teacher.turn_measures(student, teacher, tokens)
    expected_kl = np.mean(np.sum(np.exp(student) * (student - teacher), -1))
    rows = np.arange(6)
    assert kl == pytest.approx(expected_kl, rel=1e-5)
    assert change == pytest.approx(np.sum(teacher[rows, tokens] - student[rows, tokens]), rel=1e-5)
    assert feedback_teacher.turn_measures(student, student, tokens) == pytest.approx((0.0, 0.0))


def test_the_summary_pairs_the_hint_with_each_control_by_turn():
    rows = [
        {
            name: {"kl": base + shift, "logp_change": -base}
            for name, shift in zip(feedback_teacher.VARIANTS, (0.0, 0.5, 1.0))
        }
        for base in (1.0, 2.0, 4.0)
    ]
    summary = feedback_teacher.summarise(rows)
    assert summary["hint/kl"][0] == pytest.approx(7 / 3)
    # The per-turn differences are constant: the interval has no width.
    assert summary["hint - other hint/kl"] == pytest.approx((-0.5, 0.0))
    assert summary["hint - shuffled/kl"] == pytest.approx((-1.0, 0.0))
    assert summary["hint - shuffled/logp_change"] == pytest.approx((0.0, 0.0))
