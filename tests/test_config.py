"""Config conversion and validation: bad values fail before compilation, naming the field."""

import dataclasses
import os
import re
import subprocess
import sys

import ml_collections
import pytest

from composer_jax import config as C
from composer_jax import presets

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_presets_validate_and_roundtrip(name):
    cfg = presets.PRESETS[name]()
    C.validate(cfg)
    as_dict = ml_collections.ConfigDict(C.to_dict(cfg))
    assert C.from_dict(C.ExperimentConfig, as_dict) == cfg
    assert sum(C.phase_steps(cfg)) == cfg.steps


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_experts_per_tok", 9, "model.num_experts_per_tok"),
        ("n_group", 3, "model.n_group"),
        ("topk_group", 2, "model.topk_group"),
        ("qk_rope_head_dim", 5, "model.qk_rope_head_dim"),
        ("first_k_dense", 5, "model.first_k_dense"),
        ("dtype", "float8", "model.dtype"),
        ("balance_loss_alpha", -0.1, "model.balance_loss_alpha: must be a finite weight"),
    ],
)
def test_bad_model_values_name_the_field(field, value, message):
    model = dataclasses.replace(presets.tiny().model, **{field: value})
    with pytest.raises(C.ConfigError, match=message.replace(".", r"\.")):
        C.validate(dataclasses.replace(presets.tiny(), model=model))


# Every check of the experiment's own sections (the model's and RL's have their own tests):
# (path, a value that must be refused). The error names the path first.
BAD_EXPERIMENT_VALUES = [
    ("steps", 0),
    ("resume", "sometimes"),
    ("optim.name", "sgd"),
    ("optim.muon_scaling", "frobenius"),
    ("optim.muon_ns_steps", 0),
    ("optim.learning_rate", 0.0),
    ("optim.min_lr_ratio", 1.5),
    ("optim.schedule", "linear"),
    ("optim.decay_fraction", 0.0),
    ("optim.warmup_steps", -1),
    ("optim.clip_norm", 0.0),
    ("optim.qk_clip_threshold", -1.0),
    ("train.phases[0].seq_len", 1),
    ("train.phases[0].batch_size", 0),
    ("train.phases[0].microbatches", 0),
    ("train.phases[0].data", "web"),
    ("train.mtp_loss", "mse"),
    ("train.log_every", 0),
    ("train.eval_every", 0),
    ("train.checkpoint_every", 0),
    ("train.keep_checkpoints", 0),
    ("train.eval_batches", 0),
    ("data.eval_fraction", 1.0),
    ("data.tasks", " "),
    ("data.sft_style", "prose"),
    ("data.sft_tasks", 0),
    ("data.sft_feedback", 1.5),
    ("data.sft_feedback", 0.5),  # the preset's SFT style is "first_turn"
    ("data.sft_repairs", -0.1),
    ("data.sft_repairs", 0.5),  # the preset's SFT style is "first_turn"
    ("data.text_field", ""),
    ("mesh.ep", ("fsdp", "fsdp")),
    ("mesh.ep_quantize", "fp4"),
    ("mesh.ep_dispatch", "broadcast"),
    ("log.trackers", ("jsonl", "jsonl")),
]


def _with(tree: dict, path: str, value):
    """`tree` (a config as plain data) with the field at `path` ("a.b[0].c") set to `value`."""
    *parents, last = path.replace("[", ".").replace("]", "").split(".")
    node = tree
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[last] = list(value) if isinstance(value, tuple) else value
    return tree


@pytest.mark.parametrize(
    "path, value", BAD_EXPERIMENT_VALUES, ids=[p for p, _ in BAD_EXPERIMENT_VALUES]
)
def test_every_bad_experiment_value_names_its_field(path, value):
    good = C.to_dict(presets.tiny())
    cfg = C.from_dict(C.ExperimentConfig, _with(good, path, value))
    with pytest.raises(C.ConfigError, match="^" + re.escape(path) + ":"):
        C.validate(cfg)


def test_group_limited_topk_must_be_reachable():
    model = dataclasses.replace(
        presets.tiny().model, num_experts=8, n_group=4, topk_group=1, num_experts_per_tok=3
    )
    with pytest.raises(C.ConfigError, match="topk_group"):
        C.validate_model(model)


def test_unknown_and_mistyped_fields():
    data = C.to_dict(presets.tiny())
    data["model"]["num_layerz"] = 3
    with pytest.raises(C.ConfigError, match=r"config\.model\.num_layerz"):
        C.from_dict(C.ExperimentConfig, data)
    data = C.to_dict(presets.tiny())
    data["train"]["phases"][1]["seq_len"] = "long"
    with pytest.raises(C.ConfigError, match=r"config\.train\.phases\[1\]\.seq_len"):
        C.from_dict(C.ExperimentConfig, data)


def test_mesh_and_batch_must_fit_devices():
    assert C.mesh_shape(C.MeshConfig(replica=2, fsdp=-1, cp=2), 8) == {
        "replica": 2,
        "fsdp": 2,
        "cp": 2,
    }
    with pytest.raises(C.ConfigError, match="mesh.fsdp"):
        C.mesh_shape(C.MeshConfig(replica=3, fsdp=-1), 8)
    cfg = dataclasses.replace(presets.tiny(), mesh=C.MeshConfig(fsdp=8))
    phases = (C.PhaseConfig("main", 1.0, seq_len=64, batch_size=12),)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, phases=phases))
    with pytest.raises(C.ConfigError, match=r"train\.phases\[0\]\.batch_size"):
        C.validate(cfg, num_devices=8)
    # A free fsdp axis yields to cp instead, unless no sequence splits into 2*cp chunks.
    cfg = dataclasses.replace(cfg, mesh=C.MeshConfig())
    assert (C.fitted_mesh(cfg, 8).fsdp, C.fitted_mesh(cfg, 8).cp) == (4, 2)
    C.validate(cfg, num_devices=8)
    phases = (C.PhaseConfig("main", 1.0, seq_len=66, batch_size=12),)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, phases=phases))
    assert (C.fitted_mesh(cfg, 8).fsdp, C.fitted_mesh(cfg, 8).cp) == (8, 1)
    with pytest.raises(C.ConfigError, match=r"train\.phases\[0\]\.batch_size"):
        C.validate(cfg, num_devices=8)


@pytest.mark.parametrize(
    "preset", sorted(set(presets.PRESETS) - {"kimi_k2", "deepseek_v3"})
)  # kimi_k2, deepseek_v3: 128+ devices
@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_presets_fit_1_2_4_8_devices(preset, devices):
    """The presets' batches fit the device count as they are (tiny's batch of 4 on 8 devices:
    fsdp=4 x cp=2)."""
    cfg = presets.PRESETS[preset]()
    C.validate(cfg, num_devices=devices)
    mesh = C.fitted_mesh(cfg, devices)
    assert mesh.replica * mesh.fsdp * mesh.cp == devices


@pytest.mark.parametrize("preset, devices", [("kimi_k2", 128), ("deepseek_v3", 256)])
def test_the_1t_presets_are_valid_at_their_smallest_meshes(preset, devices):
    """The full-scale presets (their optimizers included: kimi_k2's MuonClip, deepseek_v3's AdamW
    with the balance loss) pass validation where launch.plan plans them."""
    cfg = presets.PRESETS[preset]()
    C.validate(cfg, num_devices=devices)
    assert cfg.optim.warmup_steps < cfg.steps


def test_phase_fractions_must_sum_to_one():
    phases = (C.PhaseConfig("a", 0.5), C.PhaseConfig("b", 0.4))
    cfg = dataclasses.replace(
        presets.tiny(), train=dataclasses.replace(presets.tiny().train, phases=phases)
    )
    with pytest.raises(C.ConfigError, match="train.phases"):
        C.validate(cfg)


def test_cli_rejects_bad_override_before_compiling(tmp_path):
    """The entry point exits with a message naming the field, without building the model."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.pretrain",
            "--config.model.num_experts_per_tok=99",
            f"--config.workdir={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "model.num_experts_per_tok" in out.stderr
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


def test_decode_chunk_must_be_positive():
    with pytest.raises(C.ConfigError, match=r"rl\.rollout\.decode_chunk"):
        C.validate_rl(C.RLConfig(rollout=C.RolloutConfig(decode_chunk=0)))
    C.validate_rl(C.RLConfig(rollout=C.RolloutConfig(decode_chunk=8)))


def test_epochs_must_be_positive():
    with pytest.raises(C.ConfigError, match=r"rl\.rollout\.epochs: must be positive"):
        C.validate_rl(C.RLConfig(rollout=C.RolloutConfig(epochs=0)))
    C.validate_rl(C.RLConfig(rollout=C.RolloutConfig(epochs=3)))


def test_uniform_by_names_its_choices():
    with pytest.raises(C.ConfigError, match=r"rl\.rollout\.uniform_by: 'length' is not one of"):
        C.validate_rl(C.RLConfig(rollout=C.RolloutConfig(uniform_by="length")))
    C.validate_rl(C.RLConfig(rollout=C.RolloutConfig(uniform_by="total")))
