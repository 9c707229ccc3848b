"""Export to the HF layout is the exact inverse of import."""

import dataclasses
import json

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from composer_jax import config, interop, model, presets


def _random_model(q_lora_rank):
    cfg = dataclasses.replace(
        presets.tiny().model,
        dtype="float32",
        q_lora_rank=q_lora_rank,
        n_group=2,
        topk_group=1,
        rope_scaling=config.YarnConfig(factor=4.0, original_max_position_embeddings=16),
    )
    m = model.init_model(cfg, seed=7)
    bias = m.moe_layers.mlp.expert_bias
    bias[...] = jax.random.normal(jax.random.key(1), bias[...].shape) * 0.3
    return m


def test_export_import_roundtrip(tmp_path):
    for q_lora_rank in (32, None):
        m = _random_model(q_lora_rank)
        interop.export_hf_checkpoint(m, tmp_path / str(q_lora_rank))
        back = interop.load_hf_checkpoint(tmp_path / str(q_lora_rank))
        ours = nnx.to_pure_dict(nnx.state(m))
        ours.pop("mtp", None)
        theirs = nnx.to_pure_dict(nnx.state(back))
        theirs.pop("mtp", None)
        jax.tree.map(np.testing.assert_array_equal, ours, theirs)
        tokens = np.random.default_rng(0).integers(0, 259, (2, 24))
        np.testing.assert_array_equal(
            np.asarray(model.compute_logits(m, tokens)),
            np.asarray(model.compute_logits(back, tokens)),
        )
        written = json.loads((tmp_path / str(q_lora_rank) / "config.json").read_text())
        assert written["q_lora_rank"] == q_lora_rank
        assert written["rope_scaling"]["type"] == "yarn"


def test_a_sharded_export_reloads_to_the_same_model_and_bfloat16_to_its_cast(tmp_path):
    m = _random_model(32)
    interop.export_hf_checkpoint(m, tmp_path / "f32", shard_bytes=64 << 10)
    index = json.loads((tmp_path / "f32" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "f32" / "model.safetensors").exists()
    assert all((tmp_path / "f32" / shard).is_file() for shard in shards)
    back = interop.load_hf_checkpoint(tmp_path / "f32")
    tokens = np.random.default_rng(1).integers(0, 259, (2, 16))
    np.testing.assert_array_equal(
        np.asarray(model.compute_logits(m, tokens)), np.asarray(model.compute_logits(back, tokens))
    )
    interop.export_hf_checkpoint(m, tmp_path / "bf16", dtype="bfloat16", shard_bytes=64 << 10)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    half = interop.load_hf_checkpoint(tmp_path / "bf16")
    ours = nnx.to_pure_dict(nnx.state(m))
    ours.pop("mtp", None)
    theirs = nnx.to_pure_dict(nnx.state(half))
    theirs.pop("mtp", None)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(
            np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32), np.asarray(b)
        ),
        ours,
        theirs,
    )
