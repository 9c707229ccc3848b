"""Sample rewards: named task / behaviour components minus a concave length penalty.

C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)) grows like x for short samples and flattens for long
ones (q > 0), so the penalty discourages needless length without making long hard tasks hopeless.
x is a weighted sum of the sample's token counts by kind, tool calls and turns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from composer_jax.rl.advantages import group_advantages, per_sample_sum
from composer_jax.rl.batch import SegmentKind, TrajectoryBatch
from composer_jax.rl.config import RLObjectiveConfig

LENGTH_FEATURES = (
    "thinking",
    "tool_call",
    "tool_output",
    "final_message",
    "summary",
    "tool_calls",
    "turns",
)
_POLICY_KINDS = {
    "thinking": SegmentKind.THINKING,
    "tool_call": SegmentKind.TOOL_CALL,
    "final_message": SegmentKind.FINAL_MESSAGE,
    "summary": SegmentKind.SUMMARY,
}


def length_penalty(x: jax.Array, k: float, q: float) -> jax.Array:
    """C(x) for x >= 0; written with expm1/log1p so it stays accurate as q -> 1."""
    x = jnp.asarray(x, jnp.float32)
    log_growth = jnp.log1p(k * x)
    if q == 1.0:
        return log_growth / k
    return jnp.expm1((1.0 - q) * log_growth) / (k * (1.0 - q))


def length_features(batch: TrajectoryBatch) -> jax.Array:
    """[N, len(LENGTH_FEATURES)] per-sample counts: policy tokens by kind, tool-output tokens,
    tool calls and turns (over every sequence of a chain)."""
    N = batch.num_samples
    in_sequence = batch.segment_ids_BT > 0
    columns = []
    for name in LENGTH_FEATURES:
        if name in _POLICY_KINDS:
            hit = batch.policy_mask_BT & (batch.kinds_BT == _POLICY_KINDS[name])
        elif name == "tool_output":
            hit = in_sequence & (batch.kinds_BT == SegmentKind.TOOL_OUTPUT)
        else:
            columns.append(batch.num_tool_calls_N if name == "tool_calls" else batch.num_turns_N)
            continue
        columns.append(per_sample_sum(hit.astype(jnp.float32), batch.sample_index_BT, N))
    return jnp.stack(columns, axis=-1).astype(jnp.float32)


def length_weights(cfg: RLObjectiveConfig) -> jax.Array:
    return jnp.array(
        [
            cfg.length_weight_thinking,
            cfg.length_weight_tool_call,
            cfg.length_weight_tool_output,
            cfg.length_weight_final_message,
            cfg.length_weight_summary,
            cfg.length_weight_per_tool_call,
            cfg.length_weight_per_turn,
        ],
        jnp.float32,
    )


def _penalties(batch: TrajectoryBatch, cfg: RLObjectiveConfig) -> tuple[jax.Array, jax.Array]:
    """(x, coef * C(x)) per sample."""
    x_N = length_features(batch) @ length_weights(cfg)
    return x_N, cfg.length_penalty_coef * length_penalty(
        x_N, cfg.length_penalty_k, cfg.length_penalty_q
    )


def sample_rewards(
    batch: TrajectoryBatch, cfg: RLObjectiveConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Total reward per sample (sum of components - coef * C(x)) and each part's mean, logged."""
    valid = batch.group_id_N >= 0
    count = jnp.maximum(valid.sum(), 1)

    def mean(x):
        return jnp.sum(jnp.where(valid, x, 0.0)) / count

    x_N, penalty_N = _penalties(batch, cfg)
    total_N = -penalty_N
    metrics = {"length_x": mean(x_N), "length_penalty": mean(penalty_N)}
    for name, value in batch.rewards_N.items():
        total_N = total_N + value
        metrics[f"reward/{name}"] = mean(value)
    metrics["reward_total"] = mean(total_N)
    return jnp.where(valid, total_N, 0.0), metrics


def parts_advantage_rms(batch: TrajectoryBatch, cfg: RLObjectiveConfig) -> dict[str, jax.Array]:
    """`advantage_rms/<part>` (`advantage_rms_metric`) of the length penalty and of each reward
    part: the trainer logs them (with the KL's and the total's, `rl.loss`); what only needs the
    total (dynamic sampling) does not pay for them."""
    _, penalty_N = _penalties(batch, cfg)
    parts = {"length_penalty": penalty_N, **batch.rewards_N}
    return {
        f"advantage_rms/{name}": advantage_rms_metric(value, batch.group_id_N)
        for name, value in parts.items()
    }


def advantage_rms_metric(part_N: jax.Array, group_id_N: jax.Array) -> jax.Array:
    """Root mean square over samples of one reward part minus its group mean: how much of the
    (Dr. GRPO) advantage that part carries. A part equal across a group (a task every sample
    passes) carries none however large it is; the advantage is the sum of the parts' centred
    values, so a part whose rms dwarfs the task reward's is what the policy gradient follows."""
    centred_N = group_advantages(part_N, group_id_N, "mean")
    valid = group_id_N >= 0
    return jnp.sqrt(jnp.sum(jnp.where(valid, centred_N**2, 0.0)) / jnp.maximum(valid.sum(), 1))
