"""A run's stored config read back by `train.workdir`: a config.json written before rl had
sections (flat rl fields, and the older renames under them) loads into the sections with one
warning line, and resumes as the same config."""

import dataclasses
import json
import logging

from composer_jax import config, presets
from composer_jax.train import workdir


def _flat_rl(rl: dict) -> dict:
    """rl as config.json held it before the sections: every section's fields at the top, the
    held-out ones prefixed `heldout_`."""
    flat = {k: v for k, v in rl.items() if k not in ("objective", "rollout", "agent", "heldout")}
    for section in ("objective", "rollout", "agent"):
        flat.update(rl[section])
    flat.update({f"heldout_{k}": v for k, v in rl["heldout"].items()})
    return flat


def test_an_old_flat_config_json_loads_into_the_sections_with_one_warning(tmp_path, caplog):
    cfg = presets.rl_tiny()
    rl = dataclasses.replace(
        cfg.rl,
        objective=dataclasses.replace(cfg.rl.objective, kl_coef=0.01),
        rollout=dataclasses.replace(cfg.rl.rollout, group_size=2, prefill_buckets=(64, 128)),
        agent=dataclasses.replace(cfg.rl.agent, max_turns=3),
        heldout=dataclasses.replace(cfg.rl.heldout, num_tasks=5, split="train"),
    )
    cfg = dataclasses.replace(cfg, rl=rl)
    stored = config.to_dict(cfg)
    stored["rl"] = _flat_rl(stored["rl"])
    stored["rl"]["heldout_tasks"] = stored["rl"].pop("heldout_num_tasks")  # an older rename too
    (tmp_path / "config.json").write_text(json.dumps(stored))
    with caplog.at_level(logging.WARNING):
        loaded = workdir.read_run_config(str(tmp_path))
    assert loaded == cfg
    assert loaded.rl.objective.kl_coef == 0.01 and loaded.rl.heldout.num_tasks == 5
    assert workdir.config_diff(loaded, cfg) == []  # a resume sees the same config
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = record.getMessage()
    assert "\n" not in message
    assert "config.rl.kl_coef is now config.rl.objective.kl_coef" in message
    assert "config.rl.heldout_num_tasks is now config.rl.heldout.num_tasks" in message
    assert "config.rl.max_turns is now config.rl.agent.max_turns" in message


def test_a_config_json_with_sections_loads_without_a_warning(tmp_path, caplog):
    cfg = presets.rl_tiny()
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict(cfg)))
    with caplog.at_level(logging.WARNING):
        assert workdir.read_run_config(str(tmp_path)) == cfg
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
