"""composer-jax models -> Hugging Face DeepSeek-V3 format (config.json + model.safetensors, or
shards with their index; with a tokenizer its files and generation_config.json).

The exact inverse of `hf.params_from_hf`, so a model survives an export/import round trip, and a
model trained here can be served by tools that read DeepSeek-V3 checkpoints (`transformers` loads
the folder). MTP heads have no counterpart in that format and are not written. The tokenizer's own
files are copied (the byte tokenizer is written as an equivalent `tokenizer.json`), and its
bos / eos / pad ids go into config.json and generation_config.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import tempfile

import jax
import ml_dtypes
import numpy as np
from etils import epath
from flax import nnx
from safetensors.numpy import save_file

from composer_jax.config import ModelConfig
from composer_jax.data.tokenizer import Tokenizer, check_vocab
from composer_jax.interop.safetensors_io import DEFAULT_FP8_BLOCK, INDEX_FILE, SCALE_SUFFIX
from composer_jax.model.transformer import Transformer


def hf_config(cfg: ModelConfig) -> dict:
    """The config.json of a model, in the DeepSeek-V3 hub format."""
    out = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "first_k_dense_replace": cfg.first_k_dense,
        "moe_layer_freq": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "n_shared_experts": cfg.num_shared_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
    }
    if cfg.rope_scaling is not None:
        y = cfg.rope_scaling
        out["rope_scaling"] = {
            "type": "yarn",
            "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
            "mscale": y.mscale,
            "mscale_all_dim": y.mscale_all_dim,
        }
    return out


def _hf_linear(w_in_out: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(w_in_out.reshape(w_in_out.shape[0], -1).T)


def _swiglu(out: dict, prefix: str, mlp: dict) -> None:
    for name in ("gate", "up", "down"):
        out[f"{prefix}{name}_proj.weight"] = _hf_linear(mlp[name])


def _layer(out: dict, index: int, layer: dict, cfg: ModelConfig) -> None:
    prefix = f"model.layers.{index}."
    attn = layer["attn"]
    a = prefix + "self_attn."
    out[prefix + "input_layernorm.weight"] = layer["attn_norm"]["scale"]
    out[prefix + "post_attention_layernorm.weight"] = layer["mlp_norm"]["scale"]
    if cfg.q_lora_rank is None:
        out[a + "q_proj.weight"] = _hf_linear(attn["q_proj"])
    else:
        out[a + "q_a_proj.weight"] = _hf_linear(attn["q_a_proj"])
        out[a + "q_a_layernorm.weight"] = attn["q_a_norm"]["scale"]
        out[a + "q_b_proj.weight"] = _hf_linear(attn["q_b_proj"])
    out[a + "kv_a_proj_with_mqa.weight"] = _hf_linear(attn["kv_a_proj"])
    out[a + "kv_a_layernorm.weight"] = attn["kv_a_norm"]["scale"]
    out[a + "kv_b_proj.weight"] = _hf_linear(attn["kv_b_proj"])
    # o_proj is [heads, v_head_dim, embed] here and [embed, heads * v_head_dim] in HF.
    out[a + "o_proj.weight"] = np.ascontiguousarray(attn["o_proj"].reshape(-1, cfg.hidden_size).T)
    mlp, m = layer["mlp"], prefix + "mlp."
    if index < cfg.first_k_dense:
        _swiglu(out, m, mlp)
        return
    out[m + "gate.weight"] = _hf_linear(mlp["router"])
    out[m + "gate.e_score_correction_bias"] = mlp["expert_bias"]
    for e in range(cfg.num_experts):
        _swiglu(out, f"{m}experts.{e}.", {k: mlp[k][e] for k in ("gate", "up", "down")})
    if cfg.num_shared_experts:
        _swiglu(out, m + "shared_experts.", mlp["shared"])


def hf_tensors(m: Transformer) -> dict[str, np.ndarray]:
    """HF-named float32 tensors of a model (MTP heads excluded)."""
    cfg = m.cfg
    state = nnx.to_pure_dict(nnx.state(m))
    state = {k: v for k, v in state.items() if k != "mtp"}
    state = jax.tree.map(lambda x: np.asarray(x, np.float32), state)
    out = {
        "model.embed_tokens.weight": state["embed"],
        "model.norm.weight": state["final_norm"]["scale"],
        "lm_head.weight": np.ascontiguousarray(state["lm_head"].T),
    }
    stacks = [
        ("dense_layers", 0, cfg.first_k_dense),
        ("moe_layers", cfg.first_k_dense, cfg.num_layers),
    ]
    for name, start, stop in stacks:
        for i in range(start, stop):
            _layer(out, i, jax.tree.map(lambda x: x[i - start], state[name]), cfg)
    return out


def generation_config(tokenizer: Tokenizer) -> dict:
    """generation_config.json: the special ids generation needs (greedy by default)."""
    out = {"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id, "do_sample": False}
    if tokenizer.bos_id is not None:
        out["bos_token_id"] = tokenizer.bos_id
    return out


EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "fp8": ml_dtypes.bfloat16}
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def quantize_fp8_blocks(w: np.ndarray, block=DEFAULT_FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3's fp8 format: e4m3 values and one float32 inverse scale per block from the
    top-left corner (edge blocks partial), each block's largest magnitude mapped to e4m3's."""
    (rows, cols), (b0, b1) = w.shape, block
    padded = np.pad(np.asarray(w, np.float32), ((0, -rows % b0), (0, -cols % b1)))
    tiles = padded.reshape(padded.shape[0] // b0, b0, padded.shape[1] // b1, b1)
    scale_inv = (np.maximum(np.abs(tiles).max(axis=(1, 3)), 1e-12) / FP8_MAX).astype(np.float32)
    q = (tiles / scale_inv[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
    return q.astype(ml_dtypes.float8_e4m3fn), scale_inv


def is_fp8_linear(name: str, w: np.ndarray) -> bool:
    """The tensors DeepSeek-V3 stores in fp8: the decoder layers' linears (not the router, norms,
    embedding or head)."""
    return w.ndim == 2 and name.startswith("model.layers.") and name.endswith("proj.weight")


def stored_tensors(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """float32 HF tensors as written for `dtype`: fp8 gives block-quantized linears with their
    `_scale_inv` and bfloat16 for the rest, like DeepSeek-V3's own release."""
    out = {}
    for name, w in tensors.items():
        if dtype == "fp8" and is_fp8_linear(name, w):
            out[name], out[name + SCALE_SUFFIX] = quantize_fp8_blocks(w)
        else:
            out[name] = w.astype(EXPORT_DTYPES[dtype])
    return out


def export_hf_checkpoint(
    m: Transformer,
    path: str | os.PathLike,
    tokenizer: Tokenizer | None = None,
    dtype: str = "float32",
    shard_bytes: int = 5 << 30,
) -> None:
    """Writes `config.json` and the weights in `dtype` (float32, the exact inverse of import,
    bfloat16, or fp8: DeepSeek-V3's 128x128-block e4m3 linears, bfloat16 elsewhere) into `path`: one `model.safetensors`, or shards of at most `shard_bytes` (a tensor
    larger than that gets a shard of its own) with `model.safetensors.index.json`; with
    `tokenizer`, also its files and `generation_config.json`. A bucket `path` (gs://) gets the
    files written to a local temporary folder first, then copied one by one (the safetensors and
    tokenizer writers take local paths)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    if "://" not in str(path):
        _write_folder(m, os.fspath(path), tokenizer, dtype, shard_bytes)
        return
    target = epath.Path(path)
    with tempfile.TemporaryDirectory(prefix="cj_export_") as local:
        _write_folder(m, local, tokenizer, dtype, shard_bytes)
        for file in sorted(pathlib.Path(local).rglob("*")):
            if file.is_file():
                destination = target / file.relative_to(local).as_posix()
                destination.parent.mkdir(parents=True, exist_ok=True)
                destination.write_bytes(file.read_bytes())


def shard_names(tensors: dict[str, np.ndarray], shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped, in name order, into shards of at most `shard_bytes`."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_shards(tensors: dict[str, np.ndarray], path: str, shard_bytes: int) -> None:
    """`tensors` as one `model.safetensors`, or as shards of at most `shard_bytes` with
    `model.safetensors.index.json`."""
    shards = shard_names(tensors, shard_bytes)
    if len(shards) == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return
    weight_map = {}
    for number, names in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: tensors[name] for name in names}, os.path.join(path, file))
        weight_map.update(dict.fromkeys(names, file))
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": weight_map,
    }
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)


def _write_folder(
    m: Transformer, path: str, tokenizer: Tokenizer | None, dtype: str, shard_bytes: int
) -> None:
    os.makedirs(path, exist_ok=True)
    config = hf_config(m.cfg)
    config["torch_dtype"] = "bfloat16" if dtype == "fp8" else dtype
    if dtype == "fp8":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": list(DEFAULT_FP8_BLOCK),
            "activation_scheme": "dynamic",
        }
    if tokenizer is not None:
        check_vocab(tokenizer, m.cfg.vocab_size)
        config.update(
            {k: v for k, v in generation_config(tokenizer).items() if k.endswith("token_id")}
        )
        tokenizer.save(path)
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(generation_config(tokenizer), f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_shards(stored_tensors(hf_tensors(m), dtype), path, shard_bytes)
