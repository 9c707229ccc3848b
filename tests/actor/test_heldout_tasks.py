"""The held-out check never plays a prompt the run trains on (SFT examples or RL prompts); the
RL prompts' epochs."""

import dataclasses

from composer_jax.actor.setup import (
    heldout_task_set,
    rl_num_prompts,
    rl_prompt_tasks,
    rl_schedule,
    trained_prompts,
)
from composer_jax.envs import task_source
from composer_jax.presets import PRESETS


def _main_job(num_tasks: int):
    cfg = PRESETS["rl_tiny"]()
    return dataclasses.replace(
        cfg,
        rl=dataclasses.replace(
            cfg.rl, heldout=dataclasses.replace(cfg.rl.heldout, num_tasks=num_tasks)
        ),
    )


def test_trained_prompts_are_the_sft_examples_and_the_rl_prompts():
    cfg = _main_job(1)
    sft = task_source(cfg.data.tasks, "data.tasks").take(cfg.data.sft_tasks, "train", cfg.seed)
    rl = rl_prompt_tasks(cfg)
    assert len(rl) == cfg.rl.rollout.num_prompts
    assert trained_prompts(cfg) == {t.prompt for t in sft} | {t.prompt for t in rl}


def test_heldout_tasks_skip_trained_prompts_and_keep_the_draw_order():
    cfg = _main_job(300)
    tasks = heldout_task_set(cfg)
    trained = trained_prompts(cfg)
    assert len(tasks) == 300 and len({t.prompt for t in tasks}) == 300
    assert not {t.prompt for t in tasks} & trained
    # Another seed's tasks repeat trained prompts (the int-input family has few), so the
    # unfiltered draw holds some: the filter removes exactly those, in order.
    draw = task_source(cfg.data.tasks, "data.tasks").take(400, "train", seed=cfg.seed + 2)
    repeated = [t for t in draw if t.prompt in trained]
    assert repeated
    kept = [t.task_id for t in draw if t.prompt not in trained][:300]
    assert [t.task_id for t in tasks][: len(kept)] == kept


def test_a_pretraining_only_warm_start_excludes_only_rl_prompts():
    cfg = _main_job(50)
    phases = tuple(dataclasses.replace(p, data="corpus") for p in cfg.train.phases)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, phases=phases))
    assert trained_prompts(cfg) == {t.prompt for t in rl_prompt_tasks(cfg)}


def _with_epochs(steps: int, epochs: int):
    cfg = _main_job(1)
    rollout = dataclasses.replace(cfg.rl.rollout, num_prompts=0, epochs=epochs)
    return dataclasses.replace(cfg, steps=steps, rl=dataclasses.replace(cfg.rl, rollout=rollout))


def test_epochs_play_every_prompt_once_a_pass_each_pass_in_its_own_order():
    cfg = _with_epochs(steps=5, epochs=3)
    tasks = rl_prompt_tasks(cfg)
    groups = cfg.steps * cfg.rl.rollout.groups_per_step
    assert len(tasks) == rl_num_prompts(cfg) == -(-groups // 3)  # rounded up: every step fills
    schedule = rl_schedule(cfg, tasks)
    assert len(schedule) == 3 * len(tasks) >= groups
    assert len({name for name, _ in schedule}) == len(schedule)  # a group id per pass
    passes = [schedule[i * len(tasks) : (i + 1) * len(tasks)] for i in range(3)]
    assert [task for _, task in passes[0]] == tasks
    orders = [[task.task_id for _, task in p] for p in passes]
    assert all(sorted(order) == sorted(orders[0]) for order in orders)
    assert len({tuple(order) for order in orders}) == 3  # each pass in its own order
    assert rl_schedule(cfg, tasks) == schedule  # drawn from the seed
    one = _with_epochs(steps=5, epochs=1)
    assert rl_num_prompts(one) == groups
    assert rl_schedule(one, tasks) == [(f"p{i:05d}", task) for i, task in enumerate(tasks)]


def test_a_longer_run_keeps_every_prompt_id_on_its_task():
    """Resuming with more steps draws more distinct prompts: an id played before (the first
    pass's and the later passes') still names the same task, so the ledger's groups stay true."""
    short, longer = _with_epochs(steps=5, epochs=2), _with_epochs(steps=10, epochs=2)
    before = dict(rl_schedule(short, rl_prompt_tasks(short)))
    after = dict(rl_schedule(longer, rl_prompt_tasks(longer)))
    assert len(after) > len(before)
    assert all(after[name].task_id == task.task_id for name, task in before.items())
