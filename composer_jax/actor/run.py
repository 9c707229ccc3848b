"""`run_rl`: warm start, held-out evaluation, the asynchronous actor loop, curves.

Everything a run writes lives in `cfg.workdir`:
  warm_start/        the SFT run that warm-starts the policy (unless rl.warm_start names one)
  checkpoints/       RL train state (orbax), every train.checkpoint_every steps and at the end
  ledger/            finished groups and which step consumed them (exactly-once on restart)
  inflight/          the groups in flight at each checkpoint (a restart resumes them mid-episode)
  weights/attempt-N/ the compressed-delta weight store of the N-th start of this run (in a
                     bucket: attempt-<unix time>)
  metrics.jsonl      one line per step (reward, pass rate, staleness, tokens/s, KL, length
                     penalty, each reward part's share of the advantage `advantage_rms/<part>`,
                     health counters), plus `heldout_reward` before RL and at the end
  heldout.json       the held-out evaluations; rl_curves.png the curves
Starting again with the same workdir resumes: the train state from the last checkpoint, finished
groups from the ledger (too-stale ones are dropped and their prompts sampled again), and the groups
that were in flight at that checkpoint from their environment snapshots.

On several JAX processes (one job, `jax.distributed`) every process runs the warm start and holds
its part of the train state; process 0 alone runs the actor loop (sampler, environments, ledger,
in-flight records, metrics, held-out evaluation), with the warm-start policy gathered onto its own
devices (`parallel.multihost.host_model`), and the others follow its trainer's calls
(`RLTrainer.follow`). The workdir must be one folder that every process sees: a shared file
system, or a `gs://` bucket (every file above goes there through epath, orbax and tensorstore;
only `rl.trace` stays local).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import signal
import time

import jax
from tqdm.auto import tqdm

from composer_jax import config as config_lib
from composer_jax.actor.coordinator import Coordinator
from composer_jax.actor.evaluator import Evaluator, HeldoutResult
from composer_jax.actor.inflight import InFlightStore
from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.report import StepRates, closing_summary, heldout_once, plot_curves
from composer_jax.actor.roles import in_flight_groups, make_roles
from composer_jax.actor.samples import groups_to_batch
from composer_jax.actor.scheduler import next_groups
from composer_jax.actor.setup import (
    check_model,
    env_timeout,
    heldout_task_set,
    rl_num_prompts,
    rl_prompt_tasks,
    rl_schedule,
    rl_task_source,
    store_dir,
    warm_start,
)
from composer_jax.actor.trainer import ProcessZeroFailed, RLTrainer
from composer_jax.agent import check_agent_config, make_workflow, reward_weights, rollout_sampling
from composer_jax.agent import env_config as agent_env_config
from composer_jax.envs import task_source
from composer_jax.parallel.multihost import LeaderChannel, host_model, is_leader
from composer_jax.trace import TRAINER, format_summary, make_tracer, summary_path
from composer_jax.train.loop import StopRequest
from composer_jax.train.metrics import MetricsWriter
from composer_jax.train.run_folder import RunFolder
from composer_jax.train.step import split_model
from composer_jax.train.trackers import check_trackers, run_params
from composer_jax.train.workdir import check_local_output, check_run_folder

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RLResult:
    final_step: int
    heldout_before: HeldoutResult | None
    heldout_after: HeldoutResult | None
    workdir: str
    staleness_histogram: dict[int, int]
    interrupted: str | None = None


def _interrupted(stop, trainer) -> bool:
    """A signal asked the run to stop, or the last weight publication failed (raises it)."""
    if trainer.last_publish is not None and trainer.last_publish.done():
        trainer.last_publish.result()  # re-raises a failed publication
    return stop.signal is not None


def run_rl(cfg: config_lib.ExperimentConfig, progress: bool = True) -> RLResult:
    """Trains (or resumes) the asynchronous RL run described by `cfg` in `cfg.workdir`."""
    folder = _start_folder(cfg)
    model = warm_start(cfg, progress)  # a job of every process
    check_model(cfg, model)
    _, warm_params, warm_buffers = split_model(model)
    model = host_model(model)  # process 0 samples and evaluates on its own devices
    channel = LeaderChannel("composer_jax/rl_trainer") if jax.process_count() > 1 else None
    if not is_leader():
        return _follow(cfg, folder, warm_params, warm_buffers, channel)
    try:
        return _lead(cfg, folder, model, warm_params, warm_buffers, channel, progress)
    except BaseException as error:
        if channel is not None:  # followers waiting for a command stop now, not at a timeout
            _send_abort(channel, error)
        raise


def _start_folder(cfg: config_lib.ExperimentConfig) -> RunFolder:
    """The run's folder, once everything that can be checked before any work is: the config,
    the agent's plug-ins and trackers, the warm start's folder, the trace's path, the
    tokenizer, the resume."""
    config_lib.validate(cfg, jax.device_count())
    check_agent_config(cfg.rl.agent)  # a plug-in that does not resolve stops before any work
    check_trackers(cfg.log)
    rl_task_source(cfg)  # the prompts' and the held-out check's task sources resolve
    if cfg.rl.heldout.tasks:
        task_source(cfg.rl.heldout.tasks, "rl.heldout.tasks")
    if cfg.rl.warm_start:  # before the workdir exists: a typo must not leave an empty run behind
        check_run_folder(cfg.rl.warm_start, "rl.warm_start")
    if cfg.rl.trace:  # written at the end: a bad path must not cost the run
        check_local_output(cfg.rl.trace, "rl.trace")
    return RunFolder.start(cfg)  # the tokenizer: the warm start's unless data.tokenizer names one


@dataclasses.dataclass
class _Loop:
    """The actor loop's parts, built once per start."""

    evaluator: Evaluator
    before: HeldoutResult
    ledger: GroupLedger
    trainer: RLTrainer
    writer: MetricsWriter
    sampler: object
    pool: object
    coordinator: Coordinator
    tracer: object
    histogram: collections.Counter = dataclasses.field(default_factory=collections.Counter)


def _lead(cfg, folder, model, warm_params, warm_buffers, channel, progress) -> RLResult:
    """Process 0 (the only one with one process): the actor loop around the trainer."""
    loop = _build(cfg, folder, model, warm_params, warm_buffers, channel, progress)
    interrupted = None
    try:
        interrupted = _train(cfg, loop, progress)
    finally:
        _stop_roles(cfg.rl, loop)
    return _close(cfg, loop, interrupted, progress)


def _evaluator(cfg, tokenizer) -> Evaluator:
    """The held-out check: the run's held-out tasks played with the agent's evaluation tools."""
    rl = cfg.rl
    return Evaluator(
        rl,
        heldout_task_set(cfg),
        tokenizer,
        rl.heldout.samples,
        rl.heldout.temperature,
        agent_env_config(rl.agent, evaluation=True),
    )


def _build(cfg, folder, model, warm_params, warm_buffers, channel, progress) -> _Loop:
    """The held-out check before RL, the trainer (restored), the ledger (rewound), the sampler,
    the environments and the coordinator with the groups that were in flight."""
    rl, tokenizer = cfg.rl, folder.tokenizer
    evaluator = _evaluator(cfg, tokenizer)
    before = heldout_once(cfg, evaluator, model, _heldout_path(cfg), "before", progress)
    ledger = GroupLedger(os.path.join(cfg.workdir, "ledger"))
    store = store_dir(cfg)
    tracer = make_tracer(rl.trace)  # no-op unless rl.trace names a file
    tracer.name_thread(TRAINER)
    if channel is not None:
        channel.send("store", store)  # the other processes build their trainers now
    trainer = RLTrainer(
        cfg, warm_params, warm_buffers, store, tracer=tracer, channel=channel, folder=folder
    )
    launch = folder.commit(trainer.restored_step, "rl")  # a refused resume has written nothing
    prompts = _prompts(cfg)
    _rewind(rl, ledger, trainer)
    writer = MetricsWriter(
        cfg.workdir, trainer.restored_step, log_config=cfg.log, params=run_params(cfg, launch)
    )
    if trainer.restored_step is None:
        writer.write(0, {"heldout_reward": before.mean, "heldout_pass_rate": before.pass_rate})
    env = agent_env_config(rl.agent)
    sampler, pool = make_roles(cfg, model, store, env_timeout(rl, env), tracer)
    try:
        coordinator = _coordinator(
            cfg, tokenizer, trainer, sampler, pool, ledger, prompts, env, tracer
        )
    except BaseException:  # the environment workers, the trace and the trackers go with the run
        tracer.close()
        pool.shutdown()
        writer.close()
        raise
    return _Loop(evaluator, before, ledger, trainer, writer, sampler, pool, coordinator, tracer)


def _coordinator(
    cfg, tokenizer, trainer, sampler, pool, ledger, prompts, env, tracer
) -> Coordinator:
    """The first weights published and pulled, then the coordinator with the groups that were
    in flight."""
    rl = cfg.rl
    tracer.start()  # the timeline: from the first publication to the rollout thread's end
    trainer.publish().result()
    sampler.sync_weights(wait_for=trainer.version)
    inflight_store = InFlightStore(os.path.join(cfg.workdir, "inflight"))
    coordinator = Coordinator(
        rl,
        sampler,
        pool,
        ledger,
        prompts,
        make_workflow(
            rl.agent,
            tokenizer,
            cfg.model,
            env,
            max_len=rl.rollout.context_len,
            sampling=rollout_sampling(rl.rollout, cfg.seed),
            distill=rl.objective.distill_coef > 0,
        ),
        env,
        seed=cfg.seed,
        resume=in_flight_groups(trainer, inflight_store),
        inflight_store=inflight_store,
        variant=rl_task_source(cfg).variant,
        tracer=tracer,
    )
    coordinator.trainer_version = trainer.version
    return coordinator


def _rewind(rl, ledger: GroupLedger, trainer: RLTrainer) -> None:
    """The ledger as the restored train state left it: the groups of steps the state never saw
    (all of them without a checkpoint) back to pending, and those now too stale dropped."""
    returned = ledger.rewind(trainer.version)
    if trainer.restored_step is not None or returned:
        log.info(
            f"Resumed RL at step {trainer.version}; {len(returned)} groups returned to "
            f"pending, {len(ledger.pending())} pending in all"
        )
    # Too stale to train on (or sampled by weights the restored state never had): drop them. The
    # scheduler samples again the prompt of every dropped group without a live successor.
    ledger.drop_stale(
        trainer.version,
        rl.rollout.max_staleness if rl.rollout.stale_policy == "drop" else 1 << 30,
        drop_newer=True,
    )


def _heldout_path(cfg) -> str:
    return os.path.join(cfg.workdir, "heldout.json")


def _prompts(cfg) -> list[tuple[str, object]]:
    """(prompt id, task) of every epoch, in the order the run plays them (`rl_schedule`)."""
    num_prompts = rl_num_prompts(cfg)
    tasks = rl_prompt_tasks(cfg)
    if len(tasks) < num_prompts:
        log.warning(
            "the RL task source has %d training tasks, fewer than the %d distinct prompts asked",
            len(tasks),
            num_prompts,
        )
    return rl_schedule(cfg, tasks)


def _train(cfg, loop: _Loop, progress: bool) -> str | None:
    """Trains until cfg.steps, the end of the prompt epoch or a signal (returned)."""
    rl, trainer, coordinator, tracer = cfg.rl, loop.trainer, loop.coordinator, loop.tracer
    bar = tqdm(
        total=cfg.steps, initial=trainer.version, desc="rl", disable=not progress, unit="step"
    )
    rates, interrupted = StepRates(), None
    try:
        with StopRequest() as stop:
            coordinator.start()
            while trainer.version < cfg.steps:
                if stop.signal:
                    interrupted = stop.signal
                    break
                version = trainer.version
                waited = time.perf_counter()
                with tracer.span("wait", "for groups"):
                    groups, weights, dropped = next_groups(
                        coordinator,
                        loop.ledger,
                        rl,
                        version,
                        interrupted=lambda: _interrupted(stop, trainer),
                    )
                waited = time.perf_counter() - waited
                if groups is None:
                    interrupted = stop.signal
                    break
                if not groups:
                    log.warning("the prompt epoch is exhausted before cfg.steps")
                    break
                loop.histogram.update(version - g.min_version for g in groups)
                with tracer.span("pack", groups=len(groups)):
                    batch = groups_to_batch(
                        groups,
                        rl.rollout.context_len,
                        row_multiple=trainer.data_parallel,
                        weights=weights,
                        min_rows=rl.rollout.groups_per_step
                        * rl.rollout.group_size,  # one shape for most steps
                        reward_weights=reward_weights(rl.agent.behaviour_rewards),
                    )
                trained = time.perf_counter()
                metrics = trainer.step(batch, stop)
                trained = time.perf_counter() - trained
                if metrics is None:  # another process has a signal: nobody trained
                    interrupted = stop.signal
                    break
                ids = [g.group_id for g in groups]
                loop.ledger.mark_trained(ids, trainer.version)
                coordinator.groups_trained(len(ids), trainer.version)
                # wait_seconds: the trainer idle, waiting for finished groups.
                extra = {"groups_dropped_stale": dropped, "wait_seconds": waited}
                extra["train_seconds"] = trained
                record = rates.record(
                    coordinator, loop.ledger, trainer, groups, version, rl, metrics, extra
                )
                loop.writer.write(trainer.version, record)
                bar.update(1)
                bar.set_postfix(
                    reward=f"{record.get('rollout_reward', math.nan):.2f}",
                    passed=f"{record.get('pass_rate', math.nan):.2f}",
                    stale=f"{record['staleness_mean']:.1f}",
                    tok_s=f"{record['tokens_per_second']:.0f}",
                    kl=f"{record.get('kl_k1', 0.0):.4f}",
                    len_pen=f"{record.get('length_penalty', 0.0):.4f}",
                )
                if trainer.version % cfg.train.checkpoint_every == 0:
                    with tracer.span("checkpoint"):
                        _checkpoint(trainer, coordinator)
            if trainer.folder.latest_step() != trainer.version and trainer.version > 0:
                with tracer.span("checkpoint"):
                    _checkpoint(trainer, coordinator)
    finally:
        bar.close()
    return interrupted


def _stop_roles(rl, loop: _Loop) -> None:
    try:
        loop.coordinator.stop()
    finally:
        loop.tracer.close()  # the loop's timeline ends with the rollout thread
        loop.pool.shutdown()
        if rl.trace:
            summary = loop.tracer.write(rl.trace)
            log.info(
                "Actor loop trace: %s (summary: %s)\n%s",
                rl.trace,
                summary_path(rl.trace),
                format_summary(summary),
            )


def _close(cfg, loop: _Loop, interrupted: str | None, progress: bool) -> RLResult:
    """The held-out check after RL (unless interrupted), the curves and the closing summary."""
    trainer = loop.trainer
    after = None
    final = trainer.host_model() if interrupted is None else None
    trainer.close(interrupted)  # the other processes return now
    if final is not None:
        key = f"after-{trainer.version}"
        after = heldout_once(cfg, loop.evaluator, final, _heldout_path(cfg), key, progress)
        loop.writer.write(
            trainer.version, {"heldout_reward": after.mean, "heldout_pass_rate": after.pass_rate}
        )
    curves = os.path.join(cfg.workdir, "rl_curves.png")
    plot_curves(loop.writer.path, curves)
    for path in (curves, _heldout_path(cfg)):
        if os.path.exists(path):
            loop.writer.artifact(path)
    loop.writer.close()
    histogram = dict(sorted(loop.histogram.items()))
    log.info("Staleness of trained groups (versions: groups): %s", histogram)
    if after is not None:
        log.info(closing_summary(cfg, loop.before, after, trainer.version))
    return RLResult(
        trainer.version, loop.before, after, cfg.workdir, histogram, interrupted=interrupted
    )


def _send_abort(channel: LeaderChannel, error: BaseException) -> None:
    try:
        channel.send("abort", f"{type(error).__name__}: {error}")
    except Exception:  # noqa: BLE001 -- the runtime itself may be what failed
        log.exception("could not tell the other processes that process 0 failed")


def _follow(cfg, folder, warm_params, warm_buffers, channel: LeaderChannel) -> RLResult:
    """A process other than 0: its part of the train state, stepped as process 0's trainer
    says; it writes only its checkpoint shards and its shards of each published version."""
    kind, store = channel.receive()
    if kind == "abort":
        raise ProcessZeroFailed(f"process 0 stopped on {store}")
    trainer = RLTrainer(cfg, warm_params, warm_buffers, store, channel=channel, folder=folder)
    with StopRequest() as stop:
        interrupted = trainer.follow(stop)
    return RLResult(trainer.version, None, None, cfg.workdir, {}, interrupted=interrupted)


def _checkpoint(trainer, coordinator, timeout_s: float = 120.0) -> None:
    """The train state, then the groups in flight at that step (waited for, so the pair is
    complete before training goes on)."""
    trainer.save({"step": trainer.version})
    coordinator.save_in_flight(trainer.version).result(timeout=timeout_s)


def exit_code(result: RLResult) -> int:
    """The shell's convention for a run stopped by a signal."""
    return 128 + int(getattr(signal, result.interrupted)) if result.interrupted else 0
