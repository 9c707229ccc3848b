"""`run_rl`: warm start, held-out evaluation, the asynchronous actor loop, curves.

Everything a run writes lives in `cfg.workdir`:
  warm_start/        the SFT run that warm-starts the policy (unless rl.warm_start names one)
  checkpoints/       RL train state (orbax), every train.checkpoint_every steps and at the end
  ledger/            finished groups and which step consumed them (exactly-once on restart)
  inflight/          the groups in flight at each checkpoint (a restart resumes them mid-episode)
  weights/attempt-N/ the compressed-delta weight store of the N-th start of this run
  metrics.jsonl      one line per step (reward, pass rate, staleness, tokens/s, KL, length
                     penalty, health counters), plus `heldout_reward` before RL and at the end
  heldout.json       the held-out evaluations; rl_curves.png the curves
Starting again with the same workdir resumes: the train state from the last checkpoint, finished
groups from the ledger (too-stale ones are dropped and their prompts sampled again), and the groups
that were in flight at that checkpoint from their environment snapshots.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from composer_jax import config as config_lib
from composer_jax import envs, interop
from composer_jax.actor.coordinator import Coordinator
from composer_jax.actor.env_workers import make_environment_pool
from composer_jax.actor.evaluator import Evaluator, HeldoutResult
from composer_jax.actor.inflight import InFlightError, InFlightStore
from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.sampler import LocalSampler
from composer_jax.actor.samples import groups_to_batch
from composer_jax.actor.scheduler import next_groups
from composer_jax.actor.trainer import RLTrainer
from composer_jax.rl.rewards import reward_weights
from composer_jax.train.loop import StopRequest, load_trained_model, run_pretraining, task_source
from composer_jax.train.metrics import MetricsWriter, read_metrics
from composer_jax.train.runs import resolve_tokenizer, save_run_tokenizer
from composer_jax.train.step import split_model
from composer_jax.train.workdir import check_run_folder, prepare_workdir, write_config


@dataclasses.dataclass
class RLResult:
    final_step: int
    heldout_before: HeldoutResult | None
    heldout_after: HeldoutResult | None
    workdir: str
    staleness_histogram: dict[int, int]
    interrupted: str | None = None


def warm_start_config(cfg: config_lib.ExperimentConfig) -> config_lib.ExperimentConfig:
    """The run of cfg.train.phases that warm-starts RL when no checkpoint is given."""
    rl = cfg.rl
    return dataclasses.replace(
        cfg,
        steps=rl.warm_start_steps,
        workdir=os.path.join(cfg.workdir, "warm_start"),
        optim=dataclasses.replace(
            cfg.optim, learning_rate=rl.warm_start_lr, warmup_steps=20, min_lr_ratio=0.1
        ),
        train=dataclasses.replace(
            cfg.train,
            eval_every=rl.warm_start_steps,
            checkpoint_every=rl.warm_start_steps,
            log_every=max(rl.warm_start_steps // 10, 1),
        ),
    )


def rl_task_source(cfg: config_lib.ExperimentConfig) -> envs.TaskSource:
    """The RL prompts' source: rl.tasks, else data.tasks."""
    field = "rl.tasks" if cfg.rl.tasks else "data.tasks"
    return task_source(cfg.rl.tasks or cfg.data.tasks, field)


def heldout_task_set(cfg: config_lib.ExperimentConfig) -> list[envs.Task]:
    """The evaluation tasks: `rl.heldout_num_tasks` of the `rl.heldout_split` split of
    rl.heldout_tasks (else the RL tasks' source), drawn with seed cfg.seed + 2 (SFT draws from
    cfg.seed, RL prompts from cfg.seed + 1: a seeded source never repeats them)."""
    rl = cfg.rl
    if rl.heldout_tasks:
        source = task_source(rl.heldout_tasks, "rl.heldout_tasks")
    else:
        source = rl_task_source(cfg)
    if rl.heldout_split not in source.splits:
        raise config_lib.ConfigError(
            f"rl.heldout_split: {source.name} has splits {source.splits}, not {rl.heldout_split!r}"
        )
    tasks = source.take(rl.heldout_num_tasks, rl.heldout_split, seed=cfg.seed + 2)
    if not tasks:
        raise config_lib.ConfigError(
            f"rl.heldout_split: {source.name} has no {rl.heldout_split!r} tasks"
        )
    return tasks


def _warm_start(cfg, progress: bool):
    if cfg.rl.warm_start:
        model, step = load_trained_model(cfg.rl.warm_start)
        print(f"Warm start: {cfg.rl.warm_start} step {step}", flush=True)
        return model
    sft = warm_start_config(cfg)
    names = ", ".join(p.name for p in sft.train.phases)
    print(f"Warm start: {sft.steps} steps of {names} in {sft.workdir}", flush=True)
    run_pretraining(sft, progress=progress, pretrained=lambda: interop.load_pretrained(sft))
    model, _ = load_trained_model(sft.workdir)
    return model


def _check_model(cfg, model) -> None:
    """The warm-start model must be the configured one (its parameters become the train state);
    only the compute dtype may differ."""
    for field in dataclasses.fields(cfg.model):
        ours, theirs = getattr(cfg.model, field.name), getattr(model.cfg, field.name)
        if field.name != "dtype" and ours != theirs:
            raise config_lib.ConfigError(
                f"model.{field.name}: the warm-start model has {theirs!r}, the config {ours!r}"
            )


def _env_timeout(rl, env_config) -> float:
    """How long an environment worker may take for one call before it counts as hung: at least
    the longest a step can legitimately take under the environment's limits."""
    needed = env_config.step_seconds()
    if rl.env_timeout_s and rl.env_timeout_s < needed:
        raise config_lib.ConfigError(
            f"rl.env_timeout_s: {rl.env_timeout_s} s is shorter than a step may legitimately take "
            f"under the environment's limits ({needed:.0f} s); use 0 to derive it"
        )
    return rl.env_timeout_s or needed


def _store_dir(cfg) -> str:
    root = cfg.rl.weight_store or os.path.abspath(os.path.join(cfg.workdir, "weights"))
    if "://" in root:
        return f"{root.rstrip('/')}/attempt-{int(time.time())}"
    os.makedirs(root, exist_ok=True)
    attempt = len([d for d in os.listdir(root) if d.startswith("attempt-")])
    return os.path.join(root, f"attempt-{attempt}")


def _heldout(cfg, evaluator, model, path, key, progress) -> HeldoutResult:
    stored = {}
    if os.path.exists(path):
        with open(path) as f:
            stored = json.load(f)
    if key in stored:
        r = stored[key]
        return HeldoutResult(np.asarray(r["per_task"]), r["pass_rate"])
    start = time.perf_counter()
    result = evaluator.evaluate(model)
    print(
        f"Held-out reward ({cfg.rl.heldout_split} split) {key.split('-')[0]} RL: {result} "
        f"[{time.perf_counter() - start:.0f} s]",
        flush=True,
    )
    stored[key] = {"per_task": result.per_task.tolist(), "pass_rate": result.pass_rate}
    with open(path, "w") as f:
        json.dump(stored, f)
    return result


def _group_metrics(groups, version: int, cfg) -> dict[str, float]:
    rewards = np.concatenate([g.rewards for g in groups])
    lags = [version - g.min_version for g in groups]
    tokens = [
        int(sum(g.arrays["sequence_lengths"][g.arrays["sequence_sample"] == i]))
        for g in groups
        for i in range(len(g.rewards))
    ]
    summaries = [s for g in groups for s in g.metadata["summaries"]]
    return {
        "reward_mean": float(rewards.mean()),
        "pass_rate": float((rewards >= 1.0).mean()),
        "staleness_mean": float(np.mean(lags)),
        "staleness_max": float(np.max(lags)),
        "summaries_per_sample": float(np.mean(summaries)),
        "tokens_per_chain": float(np.mean(tokens)),
    }


def _interrupted(stop, trainer) -> bool:
    """A signal asked the run to stop, or the last weight publication failed (raises it)."""
    if trainer.last_publish is not None and trainer.last_publish.done():
        trainer.last_publish.result()  # re-raises a failed publication
    return stop.signal is not None


def plot_curves(metrics_path: str, out_path: str) -> None:
    """Reward, pass rate, KL, length penalty and staleness against the step, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [m for m in read_metrics(metrics_path) if "reward_mean" in m]
    heldout = [m for m in read_metrics(metrics_path) if "heldout_reward" in m]
    if not lines:
        return
    steps = [m["step"] for m in lines]
    panels = (
        ("rollout_reward", "reward (all rollouts)"),
        ("pass_rate", "train pass rate"),
        ("kl_k1", "KL (k1) to reference"),
        ("length_penalty", "length penalty"),
        ("staleness_mean", "staleness (versions)"),
        ("tokens_per_second", "sampled tokens / s"),
    )
    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for ax, (key, title) in zip(axes.flat, panels):
        values = [m.get(key, np.nan) for m in lines]
        ax.plot(steps, values, lw=1.2)
        if key == "rollout_reward" and heldout:
            ax.scatter(
                [m["step"] for m in heldout],
                [m["heldout_reward"] for m in heldout],
                color="C3",
                zorder=3,
                label="held-out",
            )
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def run_rl(cfg: config_lib.ExperimentConfig, progress: bool = True) -> RLResult:
    """Trains (or resumes) the asynchronous RL run described by `cfg` in `cfg.workdir`."""
    config_lib.validate(cfg, jax.device_count())
    rl = cfg.rl
    if rl.warm_start:  # before the workdir exists: a typo must not leave an empty run behind
        check_run_folder(rl.warm_start, "rl.warm_start")
    prepare_workdir(cfg.workdir)
    tokenizer = resolve_tokenizer(cfg)  # the warm start's unless data.tokenizer names one
    save_run_tokenizer(tokenizer, cfg.workdir)
    model = _warm_start(cfg, progress)
    _check_model(cfg, model)
    _, warm_params, warm_buffers = split_model(model)

    env_config = envs.EnvConfig(max_turns=rl.max_turns, require_isolation=rl.require_sandbox)
    env_timeout_s = _env_timeout(rl, env_config)
    heldout_tasks = heldout_task_set(cfg)
    evaluator = Evaluator(
        rl, heldout_tasks, tokenizer, rl.heldout_samples, rl.heldout_temperature, env_config
    )
    heldout_path = os.path.join(cfg.workdir, "heldout.json")
    before = _heldout(cfg, evaluator, model, heldout_path, "before", progress)

    ledger = GroupLedger(os.path.join(cfg.workdir, "ledger"))
    store = _store_dir(cfg)
    trainer = RLTrainer(cfg, warm_params, warm_buffers, store)
    write_config(cfg.workdir, cfg)  # only now: a refused resume leaves the old config as it was
    num_prompts = rl.num_prompts or cfg.steps * rl.groups_per_step
    source = rl_task_source(cfg)
    tasks = source.take(num_prompts, "train", seed=cfg.seed + 1)
    if len(tasks) < num_prompts:
        print(
            f"warning: the RL task source has {len(tasks)} training tasks, fewer than the "
            f"{num_prompts} prompts of the epoch",
            flush=True,
        )
    prompts = [(f"p{i:05d}", task) for i, task in enumerate(tasks)]
    # Steps the restored state never saw (all of them without a checkpoint) give back their groups.
    returned = ledger.rewind(trainer.version)
    if trainer.restored_step is not None or returned:
        print(
            f"Resumed RL at step {trainer.version}; {len(returned)} groups returned to "
            f"pending, {len(ledger.pending())} pending in all",
            flush=True,
        )
    # Too stale to train on (or sampled by weights the restored state never had): drop them. The
    # scheduler samples again the prompt of every dropped group without a live successor.
    ledger.drop_stale(
        trainer.version, rl.max_staleness if rl.stale_policy == "drop" else 1 << 30, drop_newer=True
    )
    writer = MetricsWriter(cfg.workdir, trainer.restored_step)
    if trainer.restored_step is None:
        writer.write(0, {"heldout_reward": before.mean, "heldout_pass_rate": before.pass_rate})

    if rl.backend == "ray":
        from composer_jax.actor.ray_backend import RaySampler

        pool = make_environment_pool("ray", rl.num_env_workers, env_timeout_s)
        sampler = RaySampler(
            cfg.model, store, rl.num_slots, rl.context_len, rl.recompute_cache_on_update
        )
    else:
        pool = make_environment_pool(rl.env_workers, rl.num_env_workers, env_timeout_s)
        sampler = LocalSampler(
            model,
            store,
            num_slots=rl.num_slots,
            max_len=rl.context_len,
            recompute_cache=rl.recompute_cache_on_update,
        )
    trainer.publish().result()
    sampler.sync_weights(wait_for=trainer.version)
    inflight_store = InFlightStore(os.path.join(cfg.workdir, "inflight"))
    resume = []
    if trainer.restored_step is not None:
        try:
            resume = inflight_store.load(trainer.version)
        except InFlightError as error:  # those groups start over; nothing else is lost
            print(f"warning: {error}; the groups in flight start over", flush=True)
        if resume:
            mid = sum(not s.scored for g in resume for s in g.samples)
            print(
                f"In flight at step {trainer.version}: {len(resume)} groups ({mid} samples "
                "between turns resume from their environment snapshots)",
                flush=True,
            )
    coordinator = Coordinator(
        rl,
        sampler,
        pool,
        ledger,
        prompts,
        tokenizer,
        cfg.model.num_moe_layers,
        cfg.model.num_experts_per_tok,
        env_config,
        seed=cfg.seed,
        resume=resume,
        inflight_store=inflight_store,
        variant=source.variant,
    )
    coordinator.trainer_version = trainer.version
    histogram: collections.Counter = collections.Counter()
    interrupted = None
    bar = tqdm(
        total=cfg.steps, initial=trainer.version, desc="rl", disable=not progress, unit="step"
    )
    last_time, last_tokens, last_finished, last_reward_sum = time.perf_counter(), 0, 0, 0.0
    try:
        with StopRequest() as stop:
            coordinator.start()
            while trainer.version < cfg.steps:
                if stop.signal:
                    interrupted = stop.signal
                    break
                version = trainer.version
                waited = time.perf_counter()
                groups, weights, dropped = next_groups(
                    coordinator,
                    ledger,
                    rl,
                    version,
                    interrupted=lambda: _interrupted(stop, trainer),
                )
                waited = time.perf_counter() - waited
                if groups is None:
                    interrupted = stop.signal
                    break
                if not groups:
                    print("The prompt epoch is exhausted before cfg.steps.", flush=True)
                    break
                ids = [g.group_id for g in groups]
                histogram.update(version - g.min_version for g in groups)
                batch = groups_to_batch(
                    groups,
                    rl.context_len,
                    row_multiple=trainer.data_parallel,
                    weights=weights,
                    min_rows=rl.groups_per_step * rl.group_size,  # one shape for most steps
                    reward_weights=reward_weights(rl),
                )
                trained = time.perf_counter()
                metrics = trainer.step(batch)
                trained = time.perf_counter() - trained
                ledger.mark_trained(ids, trainer.version)
                coordinator.groups_trained(len(ids), trainer.version)
                now = time.perf_counter()
                generated = coordinator.sampler_stats.get("generated_tokens", 0)
                snapshot = coordinator.snapshot()
                finished = snapshot["rollout_reward_samples"] - last_finished
                rollout_reward = (snapshot["rollout_reward_sum"] - last_reward_sum) / max(
                    finished, 1
                )
                last_finished = snapshot["rollout_reward_samples"]
                last_reward_sum = snapshot["rollout_reward_sum"]
                record = {
                    **metrics,
                    **_group_metrics(groups, version, rl),
                    **snapshot,
                    # Every sample of the groups finished since the last step, trained or
                    # not: the policy's reward (reward_mean is over the trained groups only).
                    "rollout_reward": rollout_reward,
                    **{f"ledger/{k}": v for k, v in ledger.stats().items()},
                    "groups_dropped_stale": dropped,
                    "tokens_per_second": (generated - last_tokens) / max(now - last_time, 1e-9),
                    "seconds_per_step": now - last_time,
                    "wait_seconds": waited,  # the trainer idle, waiting for finished groups
                    "train_seconds": trained,
                }
                last_time, last_tokens = now, generated
                if trainer.last_publish is not None and trainer.last_publish.done():
                    info = trainer.last_publish.result()
                    if not info.skipped:
                        record["weight_sync_ratio"] = info.ratio
                writer.write(trainer.version, record)
                bar.update(1)
                bar.set_postfix(
                    reward=f"{rollout_reward:.2f}",
                    passed=f"{record['pass_rate']:.2f}",
                    stale=f"{record['staleness_mean']:.1f}",
                    tok_s=f"{record['tokens_per_second']:.0f}",
                    kl=f"{record.get('kl_k1', 0.0):.4f}",
                    len_pen=f"{record.get('length_penalty', 0.0):.4f}",
                )
                if trainer.version % cfg.train.checkpoint_every == 0:
                    _checkpoint(trainer, coordinator)
            if trainer.checkpointer.latest_step() != trainer.version and trainer.version > 0:
                _checkpoint(trainer, coordinator)
    finally:
        bar.close()
        coordinator.stop()
        pool.shutdown()
    after = None
    if interrupted is None:
        after = _heldout(
            cfg, evaluator, trainer.model(), heldout_path, f"after-{trainer.version}", progress
        )
        writer.write(
            trainer.version, {"heldout_reward": after.mean, "heldout_pass_rate": after.pass_rate}
        )
        diff, half = after.improvement_over(before)
        print(
            f"Held-out reward: before {before}\n                 after  {after}\n"
            f"                 paired difference {diff:+.3f} +- {half:.3f} (95% CI)",
            flush=True,
        )
    writer.close()
    trainer.close()
    plot_curves(writer.path, os.path.join(cfg.workdir, "rl_curves.png"))
    print(f"Staleness of trained groups (versions: groups): {dict(sorted(histogram.items()))}")
    return RLResult(
        trainer.version, before, after, cfg.workdir, dict(histogram), interrupted=interrupted
    )


def _checkpoint(trainer, coordinator, timeout_s: float = 120.0) -> None:
    """The train state, then the groups in flight at that step (waited for, so the pair is
    complete before training goes on)."""
    trainer.save({"step": trainer.version})
    coordinator.save_in_flight(trainer.version).result(timeout=timeout_s)


def exit_code(result: RLResult) -> int:
    """The shell's convention for a run stopped by a signal."""
    return 128 + int(getattr(signal, result.interrupted)) if result.interrupted else 0
