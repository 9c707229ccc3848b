"""A one-step categorical policy as a trajectory batch: every expectation is computable exactly.

Each sample is a sequence [prompt token, sampled token]; the policy's logits `theta` are the same
at every position, so the loss's gradient with respect to theta is the estimator under test.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.rl import RLObjectiveConfig, SegmentKind, TrajectoryBatch, policy_objective

BASE_CFG = RLObjectiveConfig(
    kl_coef=0.0,
    importance_weighting="none",
    length_penalty_coef=0.0,
    max_generation_len=1,
    advantage_mode="leave_one_out",
)


def softmax64(theta) -> np.ndarray:
    z = np.asarray(theta, np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def one_step_batch(
    samples_N: jax.Array, sampler_logp_V: jax.Array, reward_V: jax.Array, group_size: int
) -> TrajectoryBatch:
    """Batch of N one-token samples, groups of `group_size` consecutive samples."""
    N = samples_N.shape[0]
    tokens = jnp.stack([jnp.zeros_like(samples_N), samples_N], axis=1).astype(jnp.int32)
    sample_index = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32)[:, None], (N, 2))
    return TrajectoryBatch(
        tokens_BT=tokens,
        positions_BT=jnp.broadcast_to(jnp.arange(2, dtype=jnp.int32), (N, 2)),
        segment_ids_BT=jnp.ones((N, 2), jnp.int32),
        policy_mask_BT=jnp.broadcast_to(jnp.array([False, True]), (N, 2)),
        kinds_BT=jnp.full((N, 2), SegmentKind.FINAL_MESSAGE, jnp.int32),
        sampler_logprobs_BT=jnp.pad(sampler_logp_V[samples_N][:, None], ((0, 0), (1, 0))),
        policy_versions_BT=jnp.zeros((N, 2), jnp.int32),
        sample_index_BT=sample_index,
        group_id_N=jnp.arange(N, dtype=jnp.int32) // group_size,
        rewards_N={"task": reward_V[samples_N]},
        num_tool_calls_N=jnp.zeros(N),
        num_turns_N=jnp.zeros(N),
    )


def chunked_gradient(
    theta_V,
    ref_theta_V,
    reward_V,
    cfg,
    key,
    chunks=32,
    per_chunk=4096,
    group_size=4,
    behaviour=None,
):
    """Mean and standard error of the loss gradient wrt theta over `chunks` independent batches.

    Samples come from softmax(behaviour) (default theta, i.e. on-policy); the sampler's log-probs
    are the behaviour policy's.
    """
    behaviour = theta_V if behaviour is None else behaviour
    behaviour_logp = jax.nn.log_softmax(behaviour)
    ref_logp_V = jax.nn.log_softmax(ref_theta_V)
    samples = jax.random.categorical(key, behaviour, shape=(chunks, per_chunk))

    def grad_of_chunk(samples_N):
        batch = one_step_batch(samples_N, behaviour_logp, reward_V, group_size)
        ref_logprobs = jnp.pad(ref_logp_V[samples_N][:, None], ((0, 0), (1, 0)))

        def loss(theta):
            logits = jnp.broadcast_to(theta, (per_chunk, 2, theta.shape[0]))
            return policy_objective(logits, batch, cfg, ref_logprobs)[0]

        return jax.grad(loss)(theta_V)

    grads = jax.jit(jax.vmap(grad_of_chunk))(samples)
    grads = np.asarray(grads, np.float64)
    return grads.mean(0), grads.std(0, ddof=1) / np.sqrt(chunks)


def config(**changes) -> RLObjectiveConfig:
    return dataclasses.replace(BASE_CFG, **changes)
