"""The RL loss on the model: trainer forward under router replay, reference and teacher passes.

Router replay forces the experts the sampler used (`batch.router_indices_LBTK`), so the trainer's
log-probs are those of the policy that sampled, up to weight staleness; the model's
`replay_min_ratio` replaces replayed experts the trainer finds implausible, and the rate is logged.
Gates are computed live, so the router is trained through the RL loss.

`temperature`: the policy trained is softmax(logits / temperature), the distribution the sampler
draws from at that temperature (`rl.rollout.temperature`), so the importance ratio compares the
trainer's and the sampler's log-probs of the same distribution (at temperature 0.7 the untempered
log-probs put every ratio far from 1, and PPO's clip would silence most tokens). The reference
and the distillation teacher are tempered alike. A sampler nucleus (top_p < 1) is not reproduced:
the ratio is then the tempered policy over the truncated one the token came from, at most 1, a
proper importance weight towards the untruncated policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.model.transformer import ATTENTION_MAX_LOGITS, Transformer, drop_metrics, forward
from composer_jax.rl.batch import TrajectoryBatch
from composer_jax.rl.config import RLObjectiveConfig
from composer_jax.rl.loss import Metrics, policy_objective, token_logprobs


def trainer_logits(
    model: Transformer, batch: TrajectoryBatch, replay: bool = True
) -> tuple[jax.Array, Metrics]:
    """Float32 logits of the main head, the router-replay statistics and the attention maxima
    (QK-clip's input)."""
    forced = batch.router_indices_LBTK if replay else None
    out = forward(
        model,
        batch.tokens_BT,
        batch.positions_BT,
        batch.segment_ids_BT,
        forced_indices_LBTK=forced,
        with_mtp=False,
    )
    replaced = out.replay_replaced_L
    replay_slots = 0
    if forced is not None and forced.shape[0]:  # the tokens the sampler routed
        recorded_BT = (forced[0] >= 0).all(-1) & (batch.segment_ids_BT > 0)
        replay_slots = recorded_BT.sum() * model.cfg.num_experts_per_tok
    metrics = {
        "router_replaced": replaced.sum(),
        "router_replace_rate": replaced.sum() / jnp.maximum(replay_slots * replaced.shape[0], 1),
        ATTENTION_MAX_LOGITS: out.attention_max_logits,
        **drop_metrics(out, batch.segment_ids_BT, model.cfg.num_experts_per_tok),
    }
    return model.logits(out.hidden_BTD), metrics


def tempered(logits: jax.Array, temperature: float) -> jax.Array:
    """The logits of the distribution sampled at `temperature` (unchanged, bit for bit, at 1)."""
    return logits if temperature == 1.0 else logits / temperature


def reference_logits(
    model: Transformer, batch: TrajectoryBatch, temperature: float = 1.0
) -> jax.Array:
    """Logits under a reference policy (its own routing), as constants: the exact KL's input
    ([B, T, V]: a vocabulary-sized copy of the batch, for small-vocabulary studies)."""
    out = forward(model, batch.tokens_BT, batch.positions_BT, batch.segment_ids_BT, with_mtp=False)
    return jax.lax.stop_gradient(tempered(model.logits(out.hidden_BTD), temperature))


def reference_logprobs(
    model: Transformer, batch: TrajectoryBatch, temperature: float = 1.0
) -> jax.Array:
    """Token log-probs under a reference policy (its own routing), as constants."""
    return token_logprobs(reference_logits(model, batch, temperature), batch.tokens_BT)


def teacher_logits(model: Transformer, batch: TrajectoryBatch) -> jax.Array:
    """The same policy on the hinted contexts: the distillation teacher (stop-gradient)."""
    out = forward(
        model,
        batch.teacher_tokens_BT,
        batch.teacher_positions_BT,
        batch.teacher_segment_ids_BT,
        with_mtp=False,
    )
    return jax.lax.stop_gradient(model.logits(out.hidden_BTD))


def rl_loss(
    model: Transformer,
    batch: TrajectoryBatch,
    cfg: RLObjectiveConfig,
    ref_logprobs_BT: jax.Array | None = None,
    ref_logits_BTV: jax.Array | None = None,
    temperature: float = 1.0,
) -> tuple[jax.Array, Metrics]:
    """Loss and metrics of one RL step; differentiate with respect to the model's parameters.
    The references are the reference's at the same `temperature` (`reference_logprobs`)."""
    logits, metrics = trainer_logits(model, batch, replay=cfg.router_replay)
    logits = tempered(logits, temperature)
    teacher = None
    if batch.teacher_tokens_BT is not None and cfg.distill_coef > 0:
        teacher = tempered(teacher_logits(model, batch), temperature)
    loss, objective_metrics = policy_objective(
        logits, batch, cfg, ref_logprobs_BT, ref_logits_BTV, teacher
    )
    return loss, {**metrics, **objective_metrics}
