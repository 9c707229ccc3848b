"""Our forward pass reproduces Hugging Face DeepseekV3ForCausalLM logits (fixtures made by
tests/fixtures/make_hf_golden.py), and bad checkpoints fail with errors that name the tensor."""

import dataclasses
import json
import pathlib
import shutil

import numpy as np
import pytest

from composer_jax import interop, model
from composer_jax.interop import hf
from composer_jax.interop.safetensors_io import read_hf_checkpoint

FIXTURES = pathlib.Path(__file__).parent.parent / "fixtures" / "hf_deepseek_v3"


def _golden(variant):
    g = np.load(FIXTURES / variant / "golden.npz")
    return g["tokens"], g["logits"]


@pytest.mark.parametrize("variant", ["qlora", "no_qlora", "yarn", "qlora_fused", "qlora_fp8"])
def test_logits_match_transformers(variant):
    m = interop.load_hf_checkpoint(FIXTURES / variant)
    tokens, want = _golden(variant)
    got = np.asarray(model.compute_logits(m, tokens))
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_yarn_and_expert_bias_matter():
    """Guards the golden test's power: dropping YaRN or the routing bias breaks the match."""
    config, tensors = read_hf_checkpoint(FIXTURES / "yarn")
    tokens, want = _golden("yarn")
    no_yarn = hf.config_from_hf(config, rope_scaling=None)
    m = _model_from(tensors, no_yarn)
    assert np.abs(np.asarray(model.compute_logits(m, tokens)) - want).max() > 1e-2

    config, tensors = read_hf_checkpoint(FIXTURES / "qlora")
    tokens, want = _golden("qlora")
    zero_bias = {
        k: (np.zeros_like(v) if k.endswith("e_score_correction_bias") else v)
        for k, v in tensors.items()
    }
    m = _model_from(zero_bias, hf.config_from_hf(config))
    assert np.abs(np.asarray(model.compute_logits(m, tokens)) - want).max() > 1e-2


def _model_from(tensors, cfg):
    from flax import nnx

    graphdef, state = nnx.split(nnx.eval_shape(lambda: model.Transformer(cfg, nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, hf.params_from_hf(tensors, cfg))
    return nnx.merge(graphdef, state)


def test_missing_and_extra_tensors_are_named():
    config, tensors = read_hf_checkpoint(FIXTURES / "qlora")
    cfg = hf.config_from_hf(config)
    missing = dict(tensors)
    del missing["model.layers.2.self_attn.kv_b_proj.weight"]
    with pytest.raises(hf.CheckpointMismatchError, match="model.layers.2.self_attn.kv_b_proj"):
        hf.params_from_hf(missing, cfg)
    extra = dict(tensors, **{"model.layers.1.mlp.mystery.weight": np.ones((2, 2), np.float32)})
    with pytest.raises(hf.CheckpointMismatchError, match="mystery"):
        hf.params_from_hf(extra, cfg)


def test_shape_mismatch_is_named(tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "qlora", folder)
    config = json.loads((folder / "config.json").read_text())
    config["kv_lora_rank"] = 8  # The stored latent projections are 16 wide.
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(hf.CheckpointMismatchError, match="kv_a_proj|kv_b_proj|kv_a_norm"):
        interop.load_hf_checkpoint(folder)


def test_unsupported_config_is_rejected():
    config, _ = read_hf_checkpoint(FIXTURES / "qlora")
    with pytest.raises(hf.CheckpointMismatchError, match="scoring_func"):
        hf.config_from_hf(dict(config, scoring_func="softmax"))
    with pytest.raises(hf.CheckpointMismatchError, match="rope_scaling"):
        hf.config_from_hf(dict(config, rope_scaling={"rope_type": "linear", "factor": 2.0}))


def test_config_roundtrip_fields():
    config, _ = read_hf_checkpoint(FIXTURES / "yarn")
    cfg = hf.config_from_hf(config)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 4.0
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (8, 2, 2, 1)
    assert dataclasses.replace(cfg, dtype="bfloat16").dtype == "bfloat16"
