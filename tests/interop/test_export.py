"""Export to the HF layout is the exact inverse of import."""

import dataclasses
import json
import pathlib
import re

import jax
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx

from composer_jax import config, interop, model, presets
from composer_jax.interop.export import hf_tensors, quantize_fp8_blocks
from composer_jax.interop.safetensors_io import dequantize_fp8_blocks, read_hf_tensors
from composer_jax.parallel import make_layout

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf_deepseek_v3"


def _random_model(q_lora_rank, rng):
    cfg = dataclasses.replace(
        presets.tiny().model,
        dtype="float32",
        q_lora_rank=q_lora_rank,
        n_group=2,
        topk_group=1,
        rope_scaling=config.YarnConfig(factor=4.0, original_max_position_embeddings=16),
    )
    m = model.init_model(cfg, seed=int(rng.integers(2**31)))
    bias = m.moe_layers.mlp.expert_bias
    bias[...] = rng.standard_normal(bias[...].shape).astype(np.float32) * 0.3
    return m


def test_export_import_roundtrip(tmp_path, fresh_rng):
    for q_lora_rank in (32, None):
        m = _random_model(q_lora_rank, fresh_rng)
        interop.export_hf_checkpoint(m, tmp_path / str(q_lora_rank))
        back = interop.load_hf_checkpoint(tmp_path / str(q_lora_rank))
        ours = nnx.to_pure_dict(nnx.state(m))
        ours.pop("mtp", None)
        theirs = nnx.to_pure_dict(nnx.state(back))
        theirs.pop("mtp", None)
        jax.tree.map(np.testing.assert_array_equal, ours, theirs)
        tokens = fresh_rng.integers(0, 259, (2, 24))
        np.testing.assert_array_equal(
            np.asarray(model.compute_logits(m, tokens)),
            np.asarray(model.compute_logits(back, tokens)),
        )
        written = json.loads((tmp_path / str(q_lora_rank) / "config.json").read_text())
        assert written["q_lora_rank"] == q_lora_rank
        assert written["rope_scaling"]["type"] == "yarn"


def test_a_sharded_export_reloads_to_the_same_model_and_bfloat16_to_its_cast(tmp_path, fresh_rng):
    m = _random_model(32, fresh_rng)
    interop.export_hf_checkpoint(m, tmp_path / "f32", shard_bytes=64 << 10)
    index = json.loads((tmp_path / "f32" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "f32" / "model.safetensors").exists()
    assert all((tmp_path / "f32" / shard).is_file() for shard in shards)
    back = interop.load_hf_checkpoint(tmp_path / "f32")
    tokens = fresh_rng.integers(0, 259, (2, 16))
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

    def cast(path, a):  # the router's expert bias is written in float32 in every export
        exact = "expert_bias" in jax.tree_util.keystr(path)
        return np.asarray(a) if exact else np.asarray(a).astype(ml_dtypes.bfloat16)

    jax.tree.map_with_path(
        lambda path, a, b: np.testing.assert_array_equal(
            cast(path, a).astype(np.float32), np.asarray(b), err_msg=jax.tree_util.keystr(path)
        ),
        ours,
        theirs,
    )
    biases = [a for p, a in jax.tree_util.tree_leaves_with_path(ours) if "expert_bias" in str(p)]
    assert biases and all(np.any(np.asarray(b) != 0) for b in biases)  # not trivially exact


def _scaled_kinds(names) -> set[str]:
    """The kinds of tensor stored with an fp8 inverse scale, indices replaced by N."""
    return {re.sub(r"\.\d+\.", ".N.", n) for n in names if n.endswith("_scale_inv")}


def test_an_fp8_export_reloads_to_its_block_dequantization(tmp_path, fresh_rng):
    """Decoder linears are written as DeepSeek-V3's e4m3 128x128 blocks with float32 inverse
    scales (the rest in bf16, the router's bias float32); reloading gives back each block within
    e4m3's rounding (half an ulp: 1/16 relative, on the block's largest magnitude mapped to 448),
    the bf16 tensors as their cast and the bias exactly."""
    m = _random_model(32, fresh_rng)
    interop.export_hf_checkpoint(m, tmp_path / "fp8", dtype="fp8", shard_bytes=64 << 10)
    written = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert written["quantization_config"]["weight_block_size"] == [128, 128]
    stored = read_hf_tensors(tmp_path / "fp8")
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert stored[name].dtype == ml_dtypes.float8_e4m3fn and name + "_scale_inv" in stored
    assert stored["model.layers.1.mlp.gate.weight"].dtype == ml_dtypes.bfloat16  # the router
    assert stored["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == np.float32
    # The same tensors as a DeepSeek-V3 fp8 checkpoint of the hub's layout (layer and expert
    # numbers aside): the attention's kv_a_proj_with_mqa too.
    hub = json.loads((FIXTURES / "qlora_fp8" / "model.safetensors.index.json").read_text())
    assert _scaled_kinds(stored) == _scaled_kinds(hub["weight_map"])
    back = interop.load_hf_checkpoint(tmp_path / "fp8")
    want = hf_tensors(m)
    got = hf_tensors(back)
    for key, w in want.items():
        if key + "_scale_inv" in stored:
            scale = np.repeat(np.repeat(stored[key + "_scale_inv"], 128, 0), 128, 1)
            bound = scale[: w.shape[0], : w.shape[1]] * 448 / 16
            assert (np.abs(got[key] - w) <= bound + 1e-12).all(), key
            assert not np.array_equal(got[key], w)
        elif key.endswith("e_score_correction_bias"):
            np.testing.assert_array_equal(got[key], w, err_msg=key)
        else:
            np.testing.assert_array_equal(
                got[key], w.astype(ml_dtypes.bfloat16).astype(np.float32), err_msg=key
            )


def test_quantize_fp8_blocks_matches_the_blockwise_definition(fresh_rng):
    rng = fresh_rng
    w = (rng.standard_normal((70, 45)) * np.linspace(0.1, 10, 45)).astype(np.float32)
    q, scale_inv = quantize_fp8_blocks(w, (32, 16))
    assert q.shape == w.shape and scale_inv.shape == (3, 3)
    for i in range(3):
        for j in range(3):
            tile = (slice(32 * i, 32 * i + 32), slice(16 * j, 16 * j + 16))
            assert scale_inv[i, j] == np.abs(w[tile]).max() / np.float32(448)
            np.testing.assert_array_equal(
                q[tile], (w[tile] / scale_inv[i, j]).astype(ml_dtypes.float8_e4m3fn)
            )
    np.testing.assert_array_equal(
        dequantize_fp8_blocks(q, scale_inv, (32, 16)),
        q.astype(np.float32) * np.repeat(np.repeat(scale_inv, 32, 0), 16, 1)[:70, :45],
    )


def test_the_files_are_standard_safetensors(tmp_path, fresh_rng):
    """The streamed header and data read back through the safetensors library itself."""
    m = _random_model(32, fresh_rng)
    interop.export_hf_checkpoint(m, tmp_path, shard_bytes=64 << 10)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    theirs = {}
    for file in sorted(set(index["weight_map"].values())):
        theirs |= safetensors.numpy.load_file(tmp_path / file)
    ours = hf_tensors(m)
    assert sorted(theirs) == sorted(ours) == sorted(index["weight_map"])
    for name, w in ours.items():
        np.testing.assert_array_equal(theirs[name], w, err_msg=name)


def test_a_sharded_model_exports_like_one_device(tmp_path, fresh_rng):
    """A model loaded over 8 devices (fsdp x cp, experts across all) is gathered tensor by tensor
    into the same files, byte for byte, as the same model on one device."""
    m = _random_model(32, fresh_rng)
    interop.export_hf_checkpoint(m, tmp_path / "one", dtype="fp8", shard_bytes=64 << 10)
    layout = make_layout(config.MeshConfig(fsdp=4, cp=2), jax.devices()[:8])
    sharded = interop.load_hf_checkpoint(tmp_path / "one", layout=layout)
    leaves = jax.tree.leaves(nnx.to_pure_dict(nnx.state(sharded)))
    assert sum(not x.sharding.is_fully_replicated for x in leaves) > 10
    interop.export_hf_checkpoint(sharded, tmp_path / "eight", dtype="fp8", shard_bytes=64 << 10)
    interop.export_hf_checkpoint(
        interop.load_hf_checkpoint(tmp_path / "one"),
        tmp_path / "again",
        dtype="fp8",
        shard_bytes=64 << 10,
    )
    files = sorted(p.name for p in (tmp_path / "again").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "eight").iterdir())
    for name in files:
        assert (tmp_path / "eight" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
