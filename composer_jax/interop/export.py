"""composer-jax models -> Hugging Face DeepSeek-V3 format (config.json + model.safetensors, or
shards with their index; with a tokenizer its files and generation_config.json).

The exact inverse of `hf.params_from_hf`, so a model survives an export/import round trip, and a
model trained here can be served by tools that read DeepSeek-V3 checkpoints (`transformers` loads
the folder). MTP heads have no counterpart in that format and are not written. The tokenizer's own
files are copied (the byte tokenizer is written as an equivalent `tokenizer.json`), and its
bos / eos / pad ids go into config.json and generation_config.json.

Export streams: every HF tensor is a `Deferred` slice of one model leaf, gathered from the devices
only when its bytes are written, and each shard file is written header first, tensor by tensor,
straight to the target (a local folder or a bucket). Host memory holds one tensor; on several
processes each writes its own share of the shard files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from etils import epath
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tokenizers import Tokenizer as HFCore
from tokenizers import processors

from composer_jax.config import ModelConfig
from composer_jax.data.chat import chat_format_for
from composer_jax.data.tokenizer import Tokenizer, check_vocab
from composer_jax.interop.safetensors_io import DEFAULT_FP8_BLOCK, DTYPES, INDEX_FILE, SCALE_SUFFIX
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


def _hf_linear(w_in_out: Deferred) -> Deferred:
    return w_in_out.reshape(w_in_out.shape[0], -1).T


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
    out[a + "o_proj.weight"] = attn["o_proj"].reshape(-1, cfg.hidden_size).T
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


@dataclasses.dataclass(frozen=True)
class Deferred:
    """An HF tensor computed from one model leaf when it is needed: `leaf[position]`, then `ops`
    (("reshape", shape) or ("T",)). Its shape is known without touching the devices."""

    leaf: jax.Array
    position: tuple[int, ...] = ()
    ops: tuple = ()
    shape: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.shape is None:
            object.__setattr__(self, "shape", tuple(self.leaf.shape))

    def __getitem__(self, i: int) -> Deferred:
        if self.ops:
            raise ValueError("index a leaf before reshaping it")
        return dataclasses.replace(self, position=(*self.position, i), shape=self.shape[1:])

    def reshape(self, *shape: int) -> Deferred:
        known = math.prod(d for d in shape if d != -1)
        shape = tuple(math.prod(self.shape) // known if d == -1 else d for d in shape)
        return dataclasses.replace(self, ops=(*self.ops, ("reshape", shape)), shape=shape)

    @property
    def T(self) -> Deferred:
        return dataclasses.replace(self, ops=(*self.ops, ("T",)), shape=self.shape[::-1])

    def fetch(self) -> np.ndarray:
        """The tensor in float32 on this host (every process of the job must fetch it too: on a
        leaf sharded across processes this is a collective)."""
        sharding = self.leaf.sharding
        replicated = (
            NamedSharding(sharding.mesh, P()) if isinstance(sharding, NamedSharding) else None
        )
        out = _fetcher(replicated)(self.leaf, self.position, ops=self.ops)
        return np.asarray(out.addressable_data(0))


def _compute(leaf: jax.Array, position: tuple, ops: tuple) -> jax.Array:
    x = leaf[tuple(position)] if position else leaf
    for op in ops:
        x = x.reshape(op[1]) if op[0] == "reshape" else x.T
    return x.astype(jnp.float32)


@functools.cache
def _fetcher(out_sharding):
    """One jitted slice-and-gather per output sharding; positions are traced, so the layers and
    experts of a leaf share one compilation."""
    return jax.jit(_compute, static_argnames="ops", out_shardings=out_sharding)


def hf_tensor_plan(m: Transformer) -> dict[str, Deferred]:
    """HF-named tensors of a model (MTP heads excluded), each deferred until fetched."""
    cfg = m.cfg
    state = nnx.to_pure_dict(nnx.state(m))
    state = jax.tree.map(Deferred, {k: v for k, v in state.items() if k != "mtp"})
    out = {
        "model.embed_tokens.weight": state["embed"],
        "model.norm.weight": state["final_norm"]["scale"],
        "lm_head.weight": state["lm_head"].T,
    }
    stacks = [
        ("dense_layers", 0, cfg.first_k_dense),
        ("moe_layers", cfg.first_k_dense, cfg.num_layers),
    ]
    for name, start, stop in stacks:
        for i in range(start, stop):
            _layer(out, i, jax.tree.map(lambda x: x[i - start], state[name]), cfg)
    return out


def hf_tensors(m: Transformer) -> dict[str, np.ndarray]:
    """HF-named float32 tensors of a model, all on this host (small models: tests, fixtures)."""
    return {name: d.fetch() for name, d in hf_tensor_plan(m).items()}


def generation_config(tokenizer: Tokenizer) -> dict:
    """generation_config.json: greedy by default, stopping where this project's generation stops
    (eos, and the chat template's end-of-turn token when the tokenizer has a template)."""
    stops = list(chat_format_for(tokenizer).stop_token_ids)
    out = {
        "eos_token_id": stops[0] if len(stops) == 1 else stops,
        "pad_token_id": tokenizer.pad_id,
        "do_sample": False,
    }
    if tokenizer.bos_id is not None:
        out["bos_token_id"] = tokenizer.bos_id
    return out


def write_serving_tokenizer(tokenizer: Tokenizer, directory: str) -> None:
    """The tokenizer's files as transformers should serve them: encoding a prompt puts bos first,
    as this project's generation and pretraining do (`encode(add_bos=True)`), whatever the
    original post-processor did. The run's own copy keeps its files unchanged (their bytes are
    the tokenizer's fingerprint); tiktoken folders keep their own code's behaviour."""
    tokenizer.save(directory)
    path = os.path.join(directory, "tokenizer.json")
    bos = tokenizer.template_tokens.get("bos_token")
    if bos is None or not os.path.exists(path):
        return
    core = HFCore.from_file(path)
    core.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, tokenizer.bos_id)]
    )
    core.save(path)
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = (
        json.loads(pathlib.Path(config_path).read_text()) if os.path.exists(config_path) else {}
    )
    config.update(add_bos_token=True, add_eos_token=False)
    pathlib.Path(config_path).write_text(json.dumps(config, indent=2))


EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "fp8": ml_dtypes.bfloat16}
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
ROUTER_BIAS_SUFFIX = "mlp.gate.e_score_correction_bias"
_SAFETENSORS_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


def quantize_fp8_blocks(w: np.ndarray, block=DEFAULT_FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3's fp8 format: e4m3 values and one float32 inverse scale per block from the
    top-left corner (edge blocks partial), each block's largest magnitude mapped to e4m3's."""
    (rows, cols), (b0, b1) = w.shape, block
    padded = np.pad(np.asarray(w, np.float32), ((0, -rows % b0), (0, -cols % b1)))
    tiles = padded.reshape(padded.shape[0] // b0, b0, padded.shape[1] // b1, b1)
    scale_inv = (np.maximum(np.abs(tiles).max(axis=(1, 3)), 1e-12) / FP8_MAX).astype(np.float32)
    q = (tiles / scale_inv[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
    return q.astype(ml_dtypes.float8_e4m3fn), scale_inv


def is_fp8_linear(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors DeepSeek-V3 stores in fp8: the decoder layers' linears (not the router, norms,
    embedding or head)."""
    linear = name.endswith(("proj.weight", "proj_with_mqa.weight"))
    return len(shape) == 2 and name.startswith("model.layers.") and linear


def _cast_dtype(name: str, dtype: str) -> np.dtype:
    """The dtype a tensor that is not an fp8 linear is written in: `dtype`'s, but the router's
    expert bias, which stays float32 in every export (as in DeepSeek-V3's release, and as
    transformers keeps it): it only ranks experts, and bf16's 2e-3 steps at |b| ~ 0.3 change
    which experts a few percent of tokens reach."""
    if name.endswith(ROUTER_BIAS_SUFFIX):
        return np.dtype(np.float32)
    return np.dtype(EXPORT_DTYPES[dtype])


def stored_layout(
    name: str, shape: tuple[int, ...], dtype: str
) -> list[tuple[str, np.dtype, tuple]]:
    """(stored name, dtype, shape) of what one HF tensor is written as: an fp8 linear is its e4m3
    values and their float32 `_scale_inv` blocks; the rest is cast (bfloat16 under fp8, like
    DeepSeek-V3's own release; the router's expert bias float32 always)."""
    if dtype == "fp8" and is_fp8_linear(name, shape):
        blocks = tuple(-(-n // b) for n, b in zip(shape, DEFAULT_FP8_BLOCK))
        return [
            (name, np.dtype(ml_dtypes.float8_e4m3fn), shape),
            (name + SCALE_SUFFIX, np.dtype(np.float32), blocks),
        ]
    return [(name, _cast_dtype(name, dtype), shape)]


def stored_tensors(name: str, w: np.ndarray, dtype: str) -> list[np.ndarray]:
    """One float32 HF tensor as written for `dtype`, in `stored_layout`'s order."""
    if dtype == "fp8" and is_fp8_linear(name, w.shape):
        return list(quantize_fp8_blocks(w))
    return [w.astype(_cast_dtype(name, dtype))]


def export_hf_checkpoint(
    m: Transformer,
    path: str | os.PathLike,
    tokenizer: Tokenizer | None = None,
    dtype: str = "float32",
    shard_bytes: int = 5 << 30,
) -> list[str]:
    """Writes `config.json` and the weights in `dtype` (float32, the exact inverse of import,
    bfloat16, or fp8: DeepSeek-V3's 128x128-block e4m3 linears, bfloat16 elsewhere) into `path`
    (a folder or a bucket): one `model.safetensors`, or shards of at most `shard_bytes` (a tensor
    larger than that gets a shard of its own) with `model.safetensors.index.json`; with
    `tokenizer`, also its files and `generation_config.json`.

    Every process of a job calls it (a tensor sharded across processes is gathered
    collectively); process i writes shard files i, i + P, ...; process 0 the rest. Returns the
    weight files this process wrote."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    folder = epath.Path(path)
    plan = hf_tensor_plan(m)
    layouts = {name: stored_layout(name, d.shape, dtype) for name, d in plan.items()}
    sizes = {
        name: sum(math.prod(shape) * dt.itemsize for _, dt, shape in layout)
        for name, layout in layouts.items()
    }
    shards = shard_names(sizes, shard_bytes)
    files = shard_files(len(shards))
    leader = jax.process_index() == 0
    if leader:
        folder.mkdir(parents=True, exist_ok=True)
        _write_metadata(m, folder, tokenizer, dtype)
        if len(shards) > 1:
            _write_index(folder, files, shards, layouts, sizes)
    written = []
    for number, (file, names) in enumerate(zip(files, shards)):
        mine = number % jax.process_count() == jax.process_index()
        written += [file] if mine else []
        entries = [entry for name in names for entry in layouts[name]]
        with (folder / file).open("wb") if mine else contextlib.nullcontext() as f:
            if mine:
                f.write(safetensors_header(entries))
            for name in names:
                arrays = stored_tensors(name, plan[name].fetch(), dtype)  # every process fetches
                if mine:
                    for array in arrays:
                        f.write(np.ascontiguousarray(array).view(np.uint8).data)
    return written


def safetensors_header(entries: list[tuple[str, np.dtype, tuple]]) -> bytes:
    """The header of a safetensors file holding `entries` back to back in this order, padded so
    the data starts 8-byte aligned; written before the data, so tensors stream in one by one."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def shard_files(count: int) -> list[str]:
    """The weight files of `count` shards, named as the hub names them."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def shard_names(sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped, in name order, into shards of at most `shard_bytes`."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(sizes):
        if shards[-1] and size + sizes[name] > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += sizes[name]
    return shards


def _write_index(folder, files, shards, layouts, sizes) -> None:
    weight_map = {
        stored: file
        for file, names in zip(files, shards)
        for name in names
        for stored, _, _ in layouts[name]
    }
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))


def write_shards(tensors: dict[str, np.ndarray], path, shard_bytes: int) -> None:
    """In-memory `tensors` (any dtype) as one `model.safetensors`, or as shards of at most
    `shard_bytes` with `model.safetensors.index.json` (test fixtures; models use
    `export_hf_checkpoint`)."""
    folder = epath.Path(path)
    layouts = {k: [(k, v.dtype, v.shape)] for k, v in tensors.items()}
    shards = shard_names({k: v.nbytes for k, v in tensors.items()}, shard_bytes)
    files = shard_files(len(shards))
    for file, names in zip(files, shards):
        with (folder / file).open("wb") as f:
            f.write(safetensors_header([layouts[n][0] for n in names]))
            for name in names:
                f.write(np.ascontiguousarray(tensors[name]).view(np.uint8).data)
    if len(shards) > 1:
        _write_index(folder, files, shards, layouts, {k: v.nbytes for k, v in tensors.items()})


def _write_metadata(m: Transformer, folder, tokenizer: Tokenizer | None, dtype: str) -> None:
    """config.json, and with a tokenizer its files and generation_config.json (the tokenizer
    writes a local folder first: its writers take local paths)."""
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
            bos_token_id=tokenizer.bos_id,
            eos_token_id=tokenizer.eos_id,
            pad_token_id=tokenizer.pad_id,
        )
        with tempfile.TemporaryDirectory(prefix="cj_tokenizer_") as local:
            write_serving_tokenizer(tokenizer, local)
            for file in sorted(pathlib.Path(local).rglob("*")):
                if file.is_file():
                    destination = folder / file.relative_to(local).as_posix()
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    destination.write_bytes(file.read_bytes())
        (folder / "generation_config.json").write_text(
            json.dumps(generation_config(tokenizer), indent=2)
        )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
