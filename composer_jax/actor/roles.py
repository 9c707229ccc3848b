"""The roles an RL run starts around its trainer: the sampler(s) and the environment pool, in this
process (threads, worker processes) or as Ray actors, and the groups that were in flight at the
checkpoint it resumes from."""

from __future__ import annotations

import logging

import jax

from composer_jax.actor.env_workers import POOL_KINDS, EnvironmentPool, ProcessEnvironmentPool
from composer_jax.actor.inflight import InFlightError, InFlightStore
from composer_jax.actor.ray_backend import RayEnvironmentPool, RaySampler
from composer_jax.actor.sampler import LocalSampler
from composer_jax.actor.sampler_group import SamplerGroup
from composer_jax.actor.thread_pool import ThreadEnvironmentPool
from composer_jax.config.rl import parse_resources

log = logging.getLogger(__name__)


def make_environment_pool(kind: str, num_workers: int, timeout_s: float) -> EnvironmentPool:
    """A pool of `kind` ("process", "thread" or "ray")."""
    if kind == "process":
        return ProcessEnvironmentPool(num_workers, timeout_s)
    if kind == "thread":
        return ThreadEnvironmentPool(num_workers, timeout_s)
    if kind == "ray":
        return RayEnvironmentPool(num_workers, timeout_s)
    raise ValueError(f"environment pool kind must be one of {POOL_KINDS}, got {kind!r}")


def make_roles(cfg, model, store, env_timeout_s, tracer):
    """The sampler(s) and the environment pool: in this process, or Ray actors."""
    rl = cfg.rl
    if rl.rollout.backend != "ray":
        pool = make_environment_pool(
            rl.rollout.env_workers, rl.rollout.num_env_workers, env_timeout_s
        )
        pool.tracer = tracer
        sampler = LocalSampler(
            model,
            store,
            num_slots=rl.rollout.num_slots,
            max_len=rl.rollout.context_len,
            prefill_buckets=rl.rollout.prefill_buckets,
            recompute_cache=rl.rollout.recompute_cache_on_update,
            tracer=tracer,
            publishers=jax.process_count(),
            decode_chunk=rl.rollout.decode_chunk,
        )
        return sampler, pool
    samplers = [
        RaySampler(
            cfg.model,
            store,
            rl.rollout.num_slots,
            rl.rollout.context_len,
            rl.rollout.recompute_cache_on_update,
            prefill_buckets=rl.rollout.prefill_buckets,
            num_gpus=rl.rollout.ray_sampler_gpus,
            resources=parse_resources(
                rl.rollout.ray_sampler_resources, "rl.rollout.ray_sampler_resources"
            ),
            placement_timeout_s=rl.rollout.ray_placement_timeout_s,
            publishers=jax.process_count(),
            decode_chunk=rl.rollout.decode_chunk,
        )
        for _ in range(rl.rollout.num_samplers)
    ]
    sampler = samplers[0] if len(samplers) == 1 else SamplerGroup(samplers)
    pool = RayEnvironmentPool(
        rl.rollout.num_env_workers,
        env_timeout_s,
        resources=parse_resources(rl.rollout.ray_env_resources, "rl.rollout.ray_env_resources"),
        placement_timeout_s=rl.rollout.ray_placement_timeout_s,
    )
    return sampler, pool


def in_flight_groups(trainer, store: InFlightStore) -> list:
    """The groups that were in flight at the restored checkpoint ([] on a fresh start)."""
    if trainer.restored_step is None:
        return []
    try:
        resume = store.load(trainer.version)
    except InFlightError as error:  # those groups start over; nothing else is lost
        log.warning("%s; the groups in flight start over", error)
        return []
    if resume:
        mid = sum(not s.scored for g in resume for s in g.samples)
        log.info(
            f"In flight at step {trainer.version}: {len(resume)} groups ({mid} samples "
            "between turns resume from their environment snapshots)"
        )
    return resume
