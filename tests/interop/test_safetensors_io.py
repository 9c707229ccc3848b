"""Checks the torch-free checkpoint reader against the golden HF DeepSeek-V3 fixtures."""

import json
import pathlib

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from composer_jax.interop import safetensors_io as sio

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf_deepseek_v3"


def _reference_dequantize(weight, scale_inv, block):
    """One block at a time, the way the format is described."""
    out = np.empty(weight.shape, np.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows = slice(i * block[0], (i + 1) * block[0])
            cols = slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = weight[rows, cols].astype(np.float32) * scale_inv[i, j]
    return out


def _random_fp8(rng, shape):
    return np.clip(100 * rng.standard_normal(shape), -448, 448).astype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize(
    "shape,block",
    [
        ((200, 300), (128, 128)),
        ((130, 129), (128, 128)),
        ((5, 7), (128, 128)),
        ((70, 45), (32, 16)),
    ],
)
def test_dequantize_matches_blockwise_reference(shape, block, fresh_rng):
    rng = fresh_rng
    weight = _random_fp8(rng, shape)
    scale_inv = rng.uniform(0.01, 2.0, (-(-shape[0] // block[0]), -(-shape[1] // block[1]))).astype(
        np.float32
    )
    got = sio.dequantize_fp8_blocks(weight, scale_inv, block)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, _reference_dequantize(weight, scale_inv, block))


def test_dequantize_tensors_drops_scales_and_keeps_the_rest(fresh_rng):
    rng = fresh_rng
    weight, scale_inv = _random_fp8(rng, (200, 40)), np.array([[0.5], [2.0]], np.float32)
    norm = np.ones(40, ml_dtypes.bfloat16)
    out = sio.dequantize_fp8_tensors(
        {"a.weight": weight, "a.weight_scale_inv": scale_inv, "n.weight": norm}
    )
    assert sorted(out) == ["a.weight", "n.weight"]
    np.testing.assert_array_equal(
        out["a.weight"], _reference_dequantize(weight, scale_inv, (128, 128))
    )
    assert out["n.weight"] is norm


@pytest.mark.parametrize(
    "tensors,match",
    [
        (
            {
                "a.weight": np.zeros((200, 300), ml_dtypes.float8_e4m3fn),
                "a.weight_scale_inv": np.ones((2, 2), np.float32),
            },
            r"a\.weight_scale_inv: shape \[2, 2\].*needs \[2, 3\]",
        ),
        (
            {"a.weight": np.zeros((4, 4), ml_dtypes.float8_e4m3fn)},
            r"'a\.weight' is float8_e4m3fn but has no",
        ),
        (
            {"b.weight_scale_inv": np.ones((1, 1), np.float32)},
            r"scale 'b\.weight_scale_inv' has no weight",
        ),
        (
            {
                "c.weight": np.zeros((4, 4), np.float32),
                "c.weight_scale_inv": np.ones((1, 1), np.float32),
            },
            r"c\.weight: expected a 2-D float8 weight",
        ),
    ],
)
def test_dequantize_errors_name_the_tensor(tensors, match):
    with pytest.raises(ValueError, match=match):
        sio.dequantize_fp8_tensors(tensors)


def test_dtypes_round_trip_through_safetensors(tmp_path, fresh_rng):
    rng = fresh_rng
    tensors = {
        "bf16": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        "fp8": _random_fp8(rng, (4, 6)),
        "f32": rng.standard_normal(7).astype(np.float32),
        "i64": np.arange(4, dtype=np.int64),
        "empty": np.zeros((0, 3), np.float32),
    }
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
    got = sio.read_hf_tensors(tmp_path)
    assert sorted(got) == sorted(tensors)
    for name, value in tensors.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        np.testing.assert_array_equal(got[name].view(np.uint8), value.view(np.uint8))


def _write_raw_safetensors(path, header, data):
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


def test_unknown_dtype_and_bad_offsets_name_the_tensor(tmp_path):
    odd = {"odd": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}}
    _write_raw_safetensors(tmp_path / "a.safetensors", odd, b"\0" * 2)
    with pytest.raises(ValueError, match=r"tensor 'odd' has unsupported dtype Q7"):
        sio.read_hf_tensors(tmp_path)
    short = {"short": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}
    _write_raw_safetensors(tmp_path / "a.safetensors", short, b"\0" * 4)
    with pytest.raises(ValueError, match=r"tensor 'short'"):
        sio.read_hf_tensors(tmp_path)


def test_index_must_match_the_shards(tmp_path):
    safetensors.numpy.save_file({"x": np.zeros(2, np.float32)}, tmp_path / "s1.safetensors")
    index = {"metadata": {}, "weight_map": {"x": "s1.safetensors", "y": "s1.safetensors"}}
    (tmp_path / sio.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"tensor 'y' in s1\.safetensors, found in None"):
        sio.read_hf_tensors(tmp_path)


def test_sharded_fixture_reads_every_indexed_tensor():
    index = json.loads((FIXTURES / "qlora_fp8" / sio.INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert sorted(sio.read_hf_tensors(FIXTURES / "qlora_fp8")) == sorted(index["weight_map"])


def test_fused_and_per_expert_fixtures_normalize_identically():
    config, per_expert = sio.read_hf_checkpoint(FIXTURES / "qlora")
    raw_fused = sio.read_hf_tensors(FIXTURES / "qlora_fused")
    assert raw_fused["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 24, 32)
    assert raw_fused["model.layers.1.mlp.experts.down_proj"].shape == (8, 32, 12)
    _, fused = sio.read_hf_checkpoint(FIXTURES / "qlora_fused")
    assert sorted(fused) == sorted(per_expert)
    for name, value in per_expert.items():
        np.testing.assert_array_equal(fused[name], value, err_msg=name)
    assert per_expert["model.layers.2.mlp.experts.7.gate_proj.weight"].shape == (12, 32)
    assert per_expert["model.layers.2.mlp.experts.7.down_proj.weight"].shape == (32, 12)
    assert config == sio.read_hf_config(FIXTURES / "qlora_fused")


def test_expert_layout_errors_name_the_tensor():
    gate_up, down = np.zeros((2, 6, 4), np.float32), np.zeros((2, 4, 3), np.float32)
    prefix = "model.layers.0.mlp.experts."
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj has no fused partner"):
        sio.normalize_expert_layout({prefix + "gate_up_proj": gate_up}, num_layers=1)
    with pytest.raises(ValueError, match=r"are not \[E, 2F, D\] and \[E, D, F\]"):
        sio.normalize_expert_layout(
            {prefix + "gate_up_proj": gate_up, prefix + "down_proj": down.mT}, 1
        )
    with pytest.raises(ValueError, match=r"experts\.0\.up_proj\.weight' exists in both"):
        sio.normalize_expert_layout(
            {
                prefix + "gate_up_proj": gate_up,
                prefix + "down_proj": down,
                prefix + "0.up_proj.weight": down[0],
            },
            1,
        )
    with pytest.raises(
        ValueError, match=r"'model\.layers\.1\.mlp\.experts\.down_proj' is outside layers 0\.\.0"
    ):
        sio.normalize_expert_layout({"model.layers.1.mlp.experts.down_proj": down}, 1)


def test_fp8_fixture_dequantizes_close_to_float_fixture():
    raw = sio.read_hf_tensors(FIXTURES / "qlora_fp8")
    _, exact = sio.read_hf_checkpoint(FIXTURES / "qlora")
    _, dequantized = sio.read_hf_checkpoint(FIXTURES / "qlora_fp8")
    assert sorted(dequantized) == sorted(exact)
    assert raw["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)
    for name, want in exact.items():
        got = dequantized[name].astype(np.float32)
        if name + sio.SCALE_SUFFIX in raw:
            assert raw[name].dtype == ml_dtypes.float8_e4m3fn and got.dtype == np.float32
            # e4m3: 3 mantissa bits (half-ulp 2^-4 relative); subnormal half-spacing 2^-10 of the scale.
            atol = 2**-10 * np.abs(want).max() / 448
            np.testing.assert_allclose(got, want, rtol=2**-4, atol=atol, err_msg=name)
        elif raw[name].dtype == ml_dtypes.bfloat16:
            np.testing.assert_allclose(got, want, rtol=2**-8, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)


def test_config_rope_settings_come_back_in_one_form(tmp_path):
    hub = sio.read_hf_config(FIXTURES / "yarn")
    assert hub["rope_theta"] == 10000.0
    assert hub["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    assert sio.read_hf_config(FIXTURES / "qlora")["rope_scaling"] is None

    # transformers >= 5 writes the same settings as `rope_parameters`.
    v5 = json.loads((FIXTURES / "yarn" / "config.json").read_text())
    del v5["rope_theta"], v5["rope_scaling"]
    v5["rope_parameters"] = {**hub["rope_scaling"], "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(v5))
    assert sio.read_hf_config(tmp_path) == hub

    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0}
    (tmp_path / "config.json").write_text(json.dumps(v5))
    plain = sio.read_hf_config(tmp_path)
    assert plain["rope_theta"] == 50000.0 and plain["rope_scaling"] is None


def test_unsupported_quantization_is_refused(tmp_path):
    config = json.loads((FIXTURES / "qlora" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quant_method 'compressed-tensors' is not 'fp8'"):
        sio.read_hf_checkpoint(tmp_path)
