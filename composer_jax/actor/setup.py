"""What an RL run is built from before its loop starts: the warm-start policy, the prompts' and
the held-out tasks' sources, the environment workers' timeout, the weight store's location."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import time

import numpy as np

from composer_jax import agent, envs, interop
from composer_jax import config as config_lib
from composer_jax.envs import drawn_tasks, task_source
from composer_jax.train.loop import load_trained_model, run_pretraining

log = logging.getLogger(__name__)


def warm_start_config(cfg: config_lib.ExperimentConfig) -> config_lib.ExperimentConfig:
    """The run of cfg.train.phases that warm-starts RL when no checkpoint is given."""
    rl = cfg.rl
    return dataclasses.replace(
        cfg,
        steps=rl.warm_start_steps,
        workdir=os.path.join(cfg.workdir, "warm_start"),
        resume="auto",  # the RL run's own policy was applied to its workdir already
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


def _rl_tasks_field(cfg: config_lib.ExperimentConfig) -> tuple[str, str]:
    """(spec, config field) of the RL prompts' source: rl.tasks, else data.tasks."""
    return (cfg.rl.tasks, "rl.tasks") if cfg.rl.tasks else (cfg.data.tasks, "data.tasks")


def rl_task_source(cfg: config_lib.ExperimentConfig) -> envs.TaskSource:
    """The RL prompts' source: rl.tasks, else data.tasks."""
    return task_source(*_rl_tasks_field(cfg))


def rl_num_prompts(cfg: config_lib.ExperimentConfig) -> int:
    """Distinct prompts of the RL run: `rl.rollout.num_prompts`, else steps x groups per step
    over the epochs (rounded up)."""
    rollout = cfg.rl.rollout
    return rollout.num_prompts or -(-cfg.steps * rollout.groups_per_step // rollout.epochs)


def rl_prompt_tasks(cfg: config_lib.ExperimentConfig) -> list[envs.Task]:
    """The RL run's distinct prompts: `rl_num_prompts` training tasks of the RL source, seed
    cfg.seed + 1."""
    spec, field = _rl_tasks_field(cfg)
    return list(drawn_tasks(spec, field, rl_num_prompts(cfg), "train", cfg.seed + 1))


def rl_schedule(
    cfg: config_lib.ExperimentConfig, tasks: list[envs.Task]
) -> list[tuple[str, envs.Task]]:
    """(prompt id, task) in the order the run plays them: `rl.rollout.epochs` passes over `tasks`,
    the first in their drawn order, pass e in an order drawn from (cfg.seed + 1, e). Task i is
    "p<i>" in the first pass and "p<i>e<e>" in pass e: an id names the same task when a resumed
    run has more steps, and so more prompts (the draw keeps its first tasks)."""
    order = [(f"p{i:05d}", task) for i, task in enumerate(tasks)]
    for epoch in range(1, cfg.rl.rollout.epochs):
        permutation = np.random.default_rng([cfg.seed + 1, epoch]).permutation(len(tasks))
        order += [(f"p{i:05d}e{epoch}", tasks[i]) for i in permutation]
    return order


def trained_prompts(cfg: config_lib.ExperimentConfig) -> set[str]:
    """Every prompt the run trains on: its RL prompts and, when a phase fine-tunes on
    `data.tasks`, the SFT examples' tasks (seed cfg.seed, as `train.loop` draws them)."""
    prompts = {task.prompt for task in rl_prompt_tasks(cfg)}
    if cfg.data.tasks and any(phase.data == "tasks" for phase in cfg.train.phases):
        sft = drawn_tasks(cfg.data.tasks, "data.tasks", cfg.data.sft_tasks, "train", cfg.seed)
        prompts.update(task.prompt for task in sft if task.oracle_files)
    return prompts


def untrained_tasks(
    cfg: config_lib.ExperimentConfig, source: envs.TaskSource, split: str, count: int
) -> list[envs.Task]:
    """The first `count` tasks of `source`'s `split` drawn with the held-out seed (cfg.seed + 2)
    whose prompts the run never trains on (fewer where the split runs out)."""
    trained = trained_prompts(cfg)
    fresh = (t for t in source.tasks(split, seed=cfg.seed + 2) if t.prompt not in trained)
    return list(itertools.islice(fresh, count))


def heldout_task_set(cfg: config_lib.ExperimentConfig) -> list[envs.Task]:
    """The evaluation tasks: the first `rl.heldout.num_tasks` of the `rl.heldout.split` split of
    rl.heldout.tasks (else the RL tasks' source), seed cfg.seed + 2, whose prompts the run never
    trains on (`trained_prompts`). Other seeds give other task instances but not always other
    prompts (the built-in int-input tasks have few distinct ones), and a repeated prompt measures
    memorisation: RL gained about +0.1 on such tasks and nothing on the rest (RESULTS.md)."""
    rl = cfg.rl
    if rl.heldout.tasks:
        source = task_source(rl.heldout.tasks, "rl.heldout.tasks")
    else:
        source = rl_task_source(cfg)
    if rl.heldout.split not in source.splits:
        raise config_lib.ConfigError(
            f"rl.heldout.split: {source.name} has splits {source.splits}, not {rl.heldout.split!r}"
        )
    tasks = untrained_tasks(cfg, source, rl.heldout.split, rl.heldout.num_tasks)
    if not tasks:
        raise config_lib.ConfigError(
            f"rl.heldout.split: {source.name} has no {rl.heldout.split!r} tasks the run does not "
            "train on"
        )
    if len(tasks) < rl.heldout.num_tasks:
        log.warning(
            "held-out check: %d tasks, not %d (the rest of %s's %r split is trained on)",
            len(tasks),
            rl.heldout.num_tasks,
            source.name,
            rl.heldout.split,
        )
    return tasks


def warm_start(cfg, progress: bool):
    if cfg.rl.warm_start:
        model, step = load_trained_model(cfg.rl.warm_start)
        log.info("Warm start: %s step %d", cfg.rl.warm_start, step)
        return model
    sft = warm_start_config(cfg)
    names = ", ".join(p.name for p in sft.train.phases)
    log.info("Warm start: %d steps of %s in %s", sft.steps, names, sft.workdir)
    run_pretraining(
        sft,
        progress=progress,
        pretrained=functools.partial(interop.load_pretrained, sft),
        sft_examples=agent.sft_examples(sft),
    )
    model, _ = load_trained_model(sft.workdir)
    return model


def check_model(cfg, model) -> None:
    """The warm-start model must be the configured one (its parameters become the train state);
    only the compute dtype may differ."""
    for field in dataclasses.fields(cfg.model):
        ours, theirs = getattr(cfg.model, field.name), getattr(model.cfg, field.name)
        if field.name != "dtype" and ours != theirs:
            raise config_lib.ConfigError(
                f"model.{field.name}: the warm-start model has {theirs!r}, the config {ours!r}"
            )


def env_timeout(rl, env_config) -> float:
    """How long an environment worker may take for one call before it counts as hung: at least
    the longest a step can legitimately take under the environment's limits."""
    needed = env_config.step_seconds()
    if rl.rollout.env_timeout_s and rl.rollout.env_timeout_s < needed:
        raise config_lib.ConfigError(
            f"rl.rollout.env_timeout_s: {rl.rollout.env_timeout_s} s is shorter than a step may legitimately take "
            f"under the environment's limits ({needed:.0f} s); use 0 to derive it"
        )
    return rl.rollout.env_timeout_s or needed


def store_dir(cfg) -> str:
    """A weight store of this start alone (an earlier start's versions never mix with its own):
    `<root>/attempt-<N>` in a local folder; `<root>/attempt-<unix time>/` under a kvstore URL such
    as a `gs://` workdir, which trainer and sampler open as a tensorstore kvstore (the trailing
    slash: a kvstore prefixes its keys with the path as it is)."""
    root = cfg.rl.weight_store or os.path.join(cfg.workdir, "weights")
    if "://" in root:
        return f"{root.rstrip('/')}/attempt-{int(time.time())}/"
    root = os.path.abspath(root)  # Ray actors run in their runtime_env's folder, not this one
    os.makedirs(root, exist_ok=True)
    attempt = len([d for d in os.listdir(root) if d.startswith("attempt-")])
    return os.path.join(root, f"attempt-{attempt}")
