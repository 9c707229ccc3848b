"""A DeepSeek-V3-layout checkpoint written the way the hub's are: several shards with an index,
bf16 tensors next to fp8 block-quantized linears (partial edge blocks included), a config.json
with YaRN rope scaling, fp8 `quantization_config` and MTP layers stored after the decoder's."""

import json
import pathlib

import ml_dtypes
import numpy as np
from flax import nnx

from composer_jax.config import ModelConfig, YarnConfig
from composer_jax.interop.export import (
    hf_config,
    hf_tensors,
    is_fp8_linear,
    quantize_fp8_blocks,
    write_shards,
)
from composer_jax.model.transformer import Transformer


def small_config(**overrides) -> ModelConfig:
    fields = dict(
        vocab_size=384,
        hidden_size=64,
        num_layers=3,
        first_k_dense=1,
        num_heads=4,
        q_lora_rank=40,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=40,
        num_experts=8,
        num_experts_per_tok=2,
        num_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        rope_scaling=YarnConfig(factor=4.0, original_max_position_embeddings=64),
        max_position_embeddings=256,
        num_mtp_layers=0,
    )
    return ModelConfig(**{**fields, **overrides})


def _mtp_tensors(cfg: ModelConfig, layer: int, rng) -> dict[str, np.ndarray]:
    """DeepSeek-V3's MTP module (eh_proj, enorm, hnorm, shared head norm) at index `layer`."""
    d, p = cfg.hidden_size, f"model.layers.{layer}."
    return {
        p + "eh_proj.weight": rng.standard_normal((d, 2 * d)).astype(np.float32) * 0.05,
        p + "enorm.weight": np.ones(d, np.float32),
        p + "hnorm.weight": np.ones(d, np.float32),
        p + "shared_head.norm.weight": np.ones(d, np.float32),
    }


def write_checkpoint(
    folder,
    cfg: ModelConfig | None = None,
    fp8_block: tuple[int, int] | None = (48, 48),
    mtp_layers: int = 1,
    shard_bytes: int = 64 << 10,
    seed: int = 0,
) -> pathlib.Path:
    """Writes a random model of `cfg` (`small_config()` by default) to `folder`; linears in fp8
    blocks of `fp8_block` (bf16 everything when None)."""
    cfg = cfg or small_config()
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = hf_tensors(Transformer(cfg, nnx.Rngs(seed)))
    for layer in range(cfg.num_layers, cfg.num_layers + mtp_layers):
        tensors.update(_mtp_tensors(cfg, layer, rng))
    stored = {}
    for name, w in tensors.items():
        if fp8_block is not None and is_fp8_linear(name, w.shape):
            stored[name], stored[name + "_scale_inv"] = quantize_fp8_blocks(w, fp8_block)
        else:
            stored[name] = w.astype(ml_dtypes.bfloat16)
    config = hf_config(cfg) | {"num_nextn_predict_layers": mtp_layers, "torch_dtype": "bfloat16"}
    if fp8_block is not None:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": list(fp8_block),
            "activation_scheme": "dynamic",
        }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_shards(stored, str(folder), shard_bytes)
    return folder
