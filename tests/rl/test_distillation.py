"""Text-feedback distillation: KL(student || hinted teacher) on the flagged turn only."""

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.rl import SegmentKind, Sequence, pack_trajectories, policy_objective
from tests.rl import toy

K = SegmentKind
V = 9
HINT = [8, 8, 8, 8]


def _hinted_batch(rng):
    """Two samples of one group; sample 1's second turn (after a tool output) is flagged."""
    sequences = []
    for sample in range(2):
        kinds = np.array([K.PROMPT] * 3 + [K.THINKING] * 4 + [K.TOOL_OUTPUT] * 3 + [K.THINKING] * 5)
        n = len(kinds)
        seq = Sequence(
            sample_index=sample,
            tokens=rng.integers(0, V - 1, size=n),
            kinds=kinds,
            policy_mask=kinds == K.THINKING,
            sampler_logprobs=np.full(n, -1.5),
            policy_versions=np.zeros(n, np.int32),
        )
        if sample == 1:  # the hint goes right before the flagged turn (after the tool output)
            seq.teacher_tokens = np.concatenate([seq.tokens[:10], HINT, seq.tokens[10:]])
            seq.teacher_target_index = np.where(np.arange(n) >= 10, np.arange(n) + len(HINT), -1)
        sequences.append(seq)
    rewards = {"task": np.array([0.3, 0.3])}  # equal: the policy gradient is exactly 0
    return pack_trajectories(sequences, np.array([0, 0]), rewards, seq_len=20), sequences


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return (
        x
        - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - x.max(-1, keepdims=True)
    )


def test_distillation_loss_and_gradient_match_float64():
    rng = np.random.default_rng(0)
    batch, sequences = _hinted_batch(rng)
    cfg = toy.config(distill_coef=0.7, max_generation_len=16)
    student = jnp.asarray(rng.normal(size=(*batch.tokens_BT.shape, V)) * 2, jnp.float32)
    teacher = jnp.asarray(rng.normal(size=(*batch.teacher_tokens_BT.shape, V)) * 2, jnp.float32)

    def loss(s, t):
        return policy_objective(s, batch, cfg, teacher_logits_BTV=t)

    (value, metrics), (grad_s, grad_t) = jax.jit(
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    )(student, teacher)

    # float64 reference: positions of sample 1's flagged turn in the student and teacher rows.
    rows = np.asarray(batch.sample_index_BT)
    row, offset = map(int, np.argwhere(rows == 1)[0])
    t_row, t_offset = 0, 0
    normalizer = 2 * 16
    want_loss, want_grad = 0.0, np.zeros(student.shape)
    flagged = np.flatnonzero(sequences[1].teacher_target_index >= 0)
    for t in flagged:
        s_logp = _log_softmax(student[row, offset + t - 1])
        t_pos = t_offset + sequences[1].teacher_target_index[t] - 1
        t_logp = _log_softmax(teacher[t_row, t_pos])
        p = np.exp(s_logp)
        kl = np.sum(p * (s_logp - t_logp))
        want_loss += kl
        want_grad[row, offset + t - 1] = 0.7 / normalizer * p * (s_logp - t_logp - kl)
    np.testing.assert_allclose(value, 0.7 * want_loss / normalizer, rtol=1e-5)
    np.testing.assert_allclose(metrics["distill_kl"], want_loss / len(flagged), rtol=1e-5)
    np.testing.assert_allclose(grad_s, want_grad, rtol=1e-4, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(grad_t), 0)  # the teacher is a constant
    assert want_loss > 0.1


def test_only_the_flagged_turn_is_distilled():
    rng = np.random.default_rng(1)
    batch, _ = _hinted_batch(rng)
    cfg = toy.config(distill_coef=1.0)
    student = jnp.asarray(rng.normal(size=(*batch.tokens_BT.shape, V)), jnp.float32)
    teacher = jnp.asarray(rng.normal(size=(*batch.teacher_tokens_BT.shape, V)), jnp.float32)
    loss = jax.jit(lambda s: policy_objective(s, batch, cfg, teacher_logits_BTV=teacher)[0])
    base = loss(student)
    # Changing logits that predict anything outside the flagged turn changes nothing.
    predicts_flagged = np.roll(np.asarray(batch.teacher_index_BT) >= 0, -1, axis=1)
    noise = rng.normal(size=student.shape) * 5 * ~predicts_flagged[..., None]
    moved = loss(student + noise)
    np.testing.assert_allclose(moved, base, rtol=1e-6)
    assert float(base) > 0
