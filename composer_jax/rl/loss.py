"""The RL loss on given logits: group policy gradient + KL + text-feedback distillation.

Per token of sample i: -(w_it * A_i * log pi(y_it)), summed over the batch and divided by a
constant (never by a sequence's length, so a token weighs the same in a short or a long sample).
KL "in_reward" subtracts kl_coef * sum_t k_t (stop-gradient, k the chosen estimator) from the
sample's reward before the group baseline: with k1 (the default) its gradient is the
score-function gradient of KL(pi || pi_ref); k2 or k3 there is a biased penalty, kept as the
ablation other systems run. Used as a differentiable loss instead, k1 has zero expected gradient
(E_pi[grad log pi] = 0); that placement exists for ablations (with k2 it does give
grad KL(pi || ref), with k3 grad KL(ref || pi)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.rl.advantages import group_advantages, per_sample_sum, to_tokens
from composer_jax.rl.batch import TrajectoryBatch
from composer_jax.rl.config import RLObjectiveConfig
from composer_jax.rl.kl import exact_kl, kl_estimate
from composer_jax.rl.length_penalty import (
    advantage_rms_metric,
    parts_advantage_rms,
    sample_rewards,
)

Metrics = dict[str, jax.Array]
# The largest |log pi - log pi_sampler| a token's importance ratio is computed from (e^20 ~ 5e8).
MAX_LOG_RATIO = 20.0


def token_logprobs(logits_BTV: jax.Array, tokens_BT: jax.Array) -> jax.Array:
    """log pi(token t | tokens < t) stored at t (float32; 0 at t = 0, which nothing predicts)."""
    logits = logits_BTV[:, :-1].astype(jnp.float32)
    picked = jnp.take_along_axis(logits, tokens_BT[:, 1:, None], axis=-1)[..., 0]
    logp = picked - jax.nn.logsumexp(logits, axis=-1)
    return jnp.pad(logp, ((0, 0), (1, 0)))


def predicting_logits(logits_BTV: jax.Array) -> jax.Array:
    """Logits aligned with the token they predict: row t holds position t - 1's logits."""
    return jnp.roll(logits_BTV, 1, axis=1)


def trainable_mask(batch: TrajectoryBatch) -> jax.Array:
    """Policy tokens predicted from inside their own sequence."""
    segments = batch.segment_ids_BT
    same_sequence = jnp.pad(segments[:, 1:] == segments[:, :-1], ((0, 0), (1, 0)))
    return batch.policy_mask_BT & same_sequence & (segments > 0) & (batch.sample_index_BT >= 0)


def loss_normalizer(cfg: RLObjectiveConfig, num_samples: int) -> float:
    """The constant token losses are divided by: groups * G * max generation length by default."""
    return cfg.loss_normalizer or float(num_samples * cfg.max_generation_len)


def policy_gradient_token_loss(
    logp_BT: jax.Array,
    sampler_logp_BT: jax.Array,
    advantages_BT: jax.Array,
    mask_BT: jax.Array,
    cfg: RLObjectiveConfig,
) -> tuple[jax.Array, Metrics]:
    """Per-token surrogate whose gradient is -w * A * grad log pi, for the chosen weighting."""
    log_ratio = jnp.where(mask_BT, logp_BT - sampler_logp_BT, 0.0)
    # Bounded so exp stays finite in float32 (it overflows past 88.7, and PPO's clipped branch
    # then multiplies a zero cotangent by inf: a NaN gradient). A token this far off-policy gets
    # no gradient through the bound (PPO's unclipped branch for a negative advantage would push
    # it with a weight past e^20); its logged ratio stops at e^20.
    log_ratio = jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = jnp.exp(log_ratio)
    ratio_sg = jax.lax.stop_gradient(ratio)
    if cfg.importance_weighting == "none":
        loss = -advantages_BT * logp_BT
        adjusted = jnp.zeros_like(mask_BT)
    elif cfg.importance_weighting == "truncated":
        weight = jnp.minimum(ratio_sg, cfg.importance_cap)
        loss = -weight * advantages_BT * logp_BT
        adjusted = ratio_sg > cfg.importance_cap
    elif cfg.importance_weighting == "ppo_clip":
        clipped = jnp.clip(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
        unclipped_objective = ratio * advantages_BT
        clipped_objective = clipped * advantages_BT
        loss = -jnp.minimum(unclipped_objective, clipped_objective)
        adjusted = clipped_objective < unclipped_objective
    else:
        raise ValueError(f"unknown importance weighting {cfg.importance_weighting!r}")
    tokens = jnp.maximum(mask_BT.sum(), 1)
    metrics = {
        "importance_ratio_mean": jnp.sum(jnp.where(mask_BT, ratio_sg, 0.0)) / tokens,
        "importance_ratio_max": jnp.max(jnp.where(mask_BT, ratio_sg, 0.0)),
        "importance_adjusted_fraction": jnp.sum(adjusted & mask_BT) / tokens,
    }
    return jnp.where(mask_BT, loss, 0.0), metrics


def distillation_token_kl(
    logits_BTV: jax.Array, teacher_logits_BTV: jax.Array, teacher_index_BT: jax.Array
) -> jax.Array:
    """KL(student || teacher) at each distilled token (0 elsewhere); the teacher is constant.

    teacher_index_BT holds the flat position of the same token in the teacher (hinted) rows; its
    predicting position is the one before it.
    """
    V = teacher_logits_BTV.shape[-1]
    teacher_flat = jax.lax.stop_gradient(teacher_logits_BTV).reshape(-1, V)
    distilled = teacher_index_BT >= 0
    teacher = teacher_flat[jnp.maximum(teacher_index_BT - 1, 0)]
    kl = exact_kl(predicting_logits(logits_BTV), teacher)
    return jnp.where(distilled, kl, 0.0)


def policy_objective(
    logits_BTV: jax.Array,
    batch: TrajectoryBatch,
    cfg: RLObjectiveConfig,
    ref_logprobs_BT: jax.Array | None = None,
    ref_logits_BTV: jax.Array | None = None,
    teacher_logits_BTV: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """The full RL loss from the trainer's logits (recomputed under router replay) and the batch.

    Advantages are computed here, in the same step, because the KL-in-reward term depends on the
    trainer's own (stop-gradient) log-probs. Returns (loss, metrics).
    """
    N = batch.num_samples
    mask = trainable_mask(batch)
    maskf = mask.astype(jnp.float32)
    normalizer = loss_normalizer(cfg, N)
    logp = token_logprobs(logits_BTV, batch.tokens_BT)
    rewards_N, metrics = sample_rewards(batch, cfg)
    metrics.update(parts_advantage_rms(batch, cfg))
    tokens = jnp.maximum(maskf.sum(), 1.0)

    loss = jnp.zeros((), jnp.float32)
    if ref_logprobs_BT is None and ref_logits_BTV is not None:
        ref_logprobs_BT = token_logprobs(ref_logits_BTV, batch.tokens_BT)
    if ref_logprobs_BT is not None:
        # Untrained positions (prompt, tool output, padding) take the reference's log-prob, so
        # their KL is exactly 0 with a finite gradient: k3 overflows where the log-ratio is
        # below -88, and inf * 0 is NaN, in the value or in the backward pass.
        logp_kl = jnp.where(mask, logp, ref_logprobs_BT)
        k1 = jax.lax.stop_gradient(kl_estimate(logp_kl, ref_logprobs_BT, "k1"))
        k3 = jax.lax.stop_gradient(kl_estimate(logp_kl, ref_logprobs_BT, "k3"))
        metrics["kl_k1"] = jnp.sum(k1) / tokens
        metrics["kl_k3"] = jnp.sum(k3) / tokens
    if cfg.kl_coef > 0:
        if cfg.kl_estimator == "exact":
            if ref_logits_BTV is None:
                raise ValueError("kl_estimator='exact' needs the reference logits")
            kl_BT = exact_kl(predicting_logits(logits_BTV), predicting_logits(ref_logits_BTV))
        else:
            if ref_logprobs_BT is None:
                raise ValueError("kl_coef > 0 needs the reference log-probs")
            kl_BT = kl_estimate(logp_kl, ref_logprobs_BT, cfg.kl_estimator)
        kl_sum = jnp.where(mask, kl_BT, 0.0)
        if cfg.kl_placement == "in_reward":
            kl_N = per_sample_sum(jax.lax.stop_gradient(kl_sum), batch.sample_index_BT, N)
            rewards_N = rewards_N - cfg.kl_coef * kl_N
            metrics["advantage_rms/kl"] = advantage_rms_metric(cfg.kl_coef * kl_N, batch.group_id_N)
        else:
            kl_loss = cfg.kl_coef * jnp.sum(kl_sum) / normalizer
            metrics["kl_loss"] = kl_loss
            loss = loss + kl_loss

    metrics["advantage_rms/total"] = advantage_rms_metric(rewards_N, batch.group_id_N)
    advantages_N = group_advantages(
        rewards_N, batch.group_id_N, cfg.advantage_mode, cfg.advantage_std_eps
    )
    if batch.sample_weight_N is not None:
        advantages_N = advantages_N * batch.sample_weight_N
    advantages_BT = to_tokens(advantages_N, batch.sample_index_BT)
    pg_BT, is_metrics = policy_gradient_token_loss(
        logp, batch.sampler_logprobs_BT, advantages_BT, mask, cfg
    )
    pg_loss = jnp.sum(pg_BT) / normalizer
    loss = loss + pg_loss
    metrics.update(is_metrics)
    metrics["pg_loss"] = pg_loss
    valid_samples = jnp.maximum((batch.group_id_N >= 0).sum(), 1)
    metrics["advantage_abs_mean"] = jnp.sum(jnp.abs(advantages_N)) / valid_samples

    if teacher_logits_BTV is not None and batch.teacher_index_BT is not None:
        distilled = (batch.teacher_index_BT >= 0) & mask
        index = jnp.where(distilled, batch.teacher_index_BT, -1)
        distill_kl = distillation_token_kl(logits_BTV, teacher_logits_BTV, index)
        distill_loss = cfg.distill_coef * jnp.sum(distill_kl) / normalizer
        metrics["distill_kl"] = jnp.sum(distill_kl) / jnp.maximum(distilled.sum(), 1)
        metrics["distill_loss"] = distill_loss
        loss = loss + distill_loss

    versions = batch.policy_versions_BT
    metrics["policy_version_min"] = jnp.min(jnp.where(mask, versions, jnp.iinfo(jnp.int32).max))
    metrics["policy_version_max"] = jnp.max(jnp.where(mask, versions, 0))
    metrics["policy_tokens"] = maskf.sum()
    metrics["loss"] = loss
    return loss, metrics
