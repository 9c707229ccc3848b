"""The held-out check never plays a prompt the run trains on (SFT examples or RL prompts)."""

import dataclasses

from composer_jax.actor.setup import heldout_task_set, rl_prompt_tasks, trained_prompts
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
