"""experiments/feedback_teacher.py: the per-turn measures against numpy and against the trainer's
distillation term, and the paired summaries."""

import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.agent.generation import teacher_sequence
from composer_jax.model import init_model
from composer_jax.model.transformer import forward
from composer_jax.rl import distillation_token_kl
from experiments import feedback_teacher
from tests.helpers import tiny_model_config


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


def test_the_hint_against_another_is_paired_per_detector():
    def row(text, kl_hint, kl_other):
        other = {"kl": kl_other, "logp_change": 0.0}
        return {"hint_text": text, "hint": {"kl": kl_hint, "logp_change": 1.0}, "other hint": other}

    rows = [
        row("[feedback] Your previous call to todo failed with: x", 1.0, 0.5),
        row("[feedback] Your previous call to edit_file failed with: y", 2.0, 1.5),
        row("[feedback] Invalid arguments: todo: z", 1.0, 1.0),
    ]
    groups = feedback_teacher.by_hint(rows)
    assert list(groups) == ["Your previous", "Invalid arguments:"]
    assert groups["Your previous"]["turns"] == 2
    assert groups["Your previous"]["kl"] == pytest.approx((0.5, 0.0))
    assert groups["Your previous"]["logp_change"] == pytest.approx((1.0, 0.0))
    assert groups["Invalid arguments:"]["kl"][0] == pytest.approx(0.0)


def test_the_hint_teachers_kl_is_the_trainers_distillation_term(fresh_rng):
    """On one sequence with two hinted turns, the script's per-turn KL is the mean of the RL loss's
    `distillation_token_kl` over that turn: both read the teacher at the same positions."""
    model = init_model(tiny_model_config(), seed=int(fresh_rng.integers(1 << 16)))
    tokens = fresh_rng.integers(3, 250, 70).astype(np.int32)
    spans = [(20, 31, np.array([5, 6, 7], np.int32)), (45, 52, np.array([8, 9], np.int32))]
    teacher_tokens, target = teacher_sequence(tokens, spans)

    def logits(row):
        positions = jnp.arange(len(row))[None]
        out = forward(
            model, jnp.asarray(row)[None], positions, jnp.ones_like(positions), with_mtp=False
        )
        return model.logits(out.hidden_BTD).astype(jnp.float32)

    trainer_kl = np.asarray(
        distillation_token_kl(logits(tokens), logits(teacher_tokens), jnp.asarray(target)[None])
    )[0]
    student = feedback_teacher._log_softmax_rows(model, tokens)
    teacher = feedback_teacher._log_softmax_rows(model, teacher_tokens)
    for start, end, _ in spans:
        kl, _ = feedback_teacher.turn_scores(student, teacher, target, tokens, (start, end))
        assert kl == pytest.approx(trainer_kl[start:end].mean(), rel=1e-4, abs=1e-6)
        assert kl > 1e-4  # the hint moved the teacher
