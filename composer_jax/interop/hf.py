"""Hugging Face DeepSeek-V3 / Kimi-K2 checkpoints -> composer-jax models.

`streaming.hf_sources` gives HF-named lazy tensors (dequantized, experts per expert); this module
maps them onto the model's stacked parameters without reading data, then each device's shard of
each parameter is read and placed piece by piece (`load_hf_checkpoint`). Every HF tensor must be
used and every model parameter filled, or the error names the ones that are not.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from tqdm.auto import tqdm

from composer_jax.config import ModelConfig, YarnConfig, validate_model
from composer_jax.interop.streaming import (
    DEFAULT_BUFFER_BYTES,
    ArraySource,
    CheckpointReader,
    Source,
    SplitAxis,
    Stacked,
    Transposed,
    full_index,
    hf_sources,
    normalize,
    pieces,
)
from composer_jax.model.layers import logical_axes_of
from composer_jax.model.transformer import Transformer
from composer_jax.parallel.mesh import Layout


class CheckpointMismatchError(ValueError):
    """HF tensors and model parameters do not correspond; the message names them."""


# HF config values this implementation assumes; anything else would silently compute another model.
_REQUIRED = {
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "moe_layer_freq": 1,
    "tie_word_embeddings": False,
}


def unsupported_fields(hf: dict) -> list[str]:
    """Every setting of an HF `config.json` this implementation cannot represent (each would
    silently compute another model), as "key=value (expected ...)" lines."""
    problems = [
        f"{key}={hf[key]!r} (expected {want!r})"
        for key, want in _REQUIRED.items()
        if key in hf and hf[key] != want
    ]
    scaling = hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if scaling and kind != "yarn":
        problems.append(f"rope_scaling type {kind!r} (expected 'yarn' or none)")
    quant = hf.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "fp8":
        problems.append(
            f"quantization_config.quant_method={quant.get('quant_method')!r} (expected 'fp8')"
        )
    block = quant.get("weight_block_size")
    if block is not None and not (
        isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) for b in block)
    ):
        problems.append(f"quantization_config.weight_block_size={block!r} (expected [rows, cols])")
    if hf.get("attention_bias"):
        problems.append("attention_bias=True (expected False)")
    return problems


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig of an HF `config.json` (as normalised by `read_hf_config`); every setting it
    cannot represent is named in one error."""
    problems = unsupported_fields(hf)
    if problems:
        raise CheckpointMismatchError(f"config.json: unsupported {'; '.join(problems)}")
    scaling = hf.get("rope_scaling")
    yarn = None
    if scaling:
        yarn = YarnConfig(
            factor=float(scaling["factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            beta_fast=float(scaling.get("beta_fast", 32)),
            beta_slow=float(scaling.get("beta_slow", 1)),
            mscale=float(scaling.get("mscale", 1)),
            mscale_all_dim=float(scaling.get("mscale_all_dim", 0)),
        )
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        first_k_dense=hf.get("first_k_dense_replace", 0),
        num_heads=hf["num_attention_heads"],
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_theta=float(hf.get("rope_theta", 10000.0)),
        rope_scaling=yarn,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        intermediate_size=hf["intermediate_size"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        num_experts=hf["n_routed_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        num_shared_experts=hf.get("n_shared_experts") or 0,
        n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        # DeepSeek's MTP layers use another block structure; MTP heads are trained from scratch.
        num_mtp_layers=0,
    )
    cfg = dataclasses.replace(cfg, **overrides)
    validate_model(cfg)
    return cfg


class _Tensors:
    """HF sources by name, recording which names were consumed."""

    def __init__(self, sources: dict[str, Source]):
        self._sources = sources
        self.used: set[str] = set()

    def __call__(self, name: str) -> Source:
        if name not in self._sources:
            raise CheckpointMismatchError(f"checkpoint lacks tensor {name!r}")
        self.used.add(name)
        return self._sources[name]

    def unused(self) -> list[str]:
        return sorted(set(self._sources) - self.used)


def _linear(w_out_in: Source) -> Source:
    """HF Linear weights are [out, in]; ours are [in, out]."""
    return Transposed(w_out_in)


def _heads(w: Source, *parts: int) -> Source:
    """A linear's output axis split per head: [in, h * d] -> [in, h, d]."""
    return SplitAxis(w, 1, parts)


def _attention(get: _Tensors, prefix: str, cfg: ModelConfig) -> dict:
    h = cfg.num_heads
    a = {}
    if cfg.q_lora_rank is None:
        a["q_proj"] = _heads(_linear(get(prefix + "q_proj.weight")), h, -1)
    else:
        a["q_a_proj"] = _linear(get(prefix + "q_a_proj.weight"))
        a["q_a_norm"] = {"scale": get(prefix + "q_a_layernorm.weight")}
        a["q_b_proj"] = _heads(_linear(get(prefix + "q_b_proj.weight")), h, -1)
    a["kv_a_proj"] = _linear(get(prefix + "kv_a_proj_with_mqa.weight"))
    a["kv_a_norm"] = {"scale": get(prefix + "kv_a_layernorm.weight")}
    a["kv_b_proj"] = _heads(_linear(get(prefix + "kv_b_proj.weight")), h, -1)
    # o_proj's input axis is the heads': [h * v, D] -> [h, v, D].
    a["o_proj"] = SplitAxis(_linear(get(prefix + "o_proj.weight")), 0, (h, cfg.v_head_dim))
    return a


def _swiglu(get: _Tensors, prefix: str) -> dict:
    return {name: _linear(get(f"{prefix}{name}_proj.weight")) for name in ("gate", "up", "down")}


def _layer(get: _Tensors, index: int, cfg: ModelConfig) -> dict:
    prefix = f"model.layers.{index}."
    layer = {
        "attn_norm": {"scale": get(prefix + "input_layernorm.weight")},
        "attn": _attention(get, prefix + "self_attn.", cfg),
        "mlp_norm": {"scale": get(prefix + "post_attention_layernorm.weight")},
    }
    mlp = prefix + "mlp."
    if index < cfg.first_k_dense:
        layer["mlp"] = _swiglu(get, mlp)
        return layer
    experts = [_swiglu(get, f"{mlp}experts.{e}.") for e in range(cfg.num_experts)]
    layer["mlp"] = {
        "router": _linear(get(mlp + "gate.weight")),
        "expert_bias": get(mlp + "gate.e_score_correction_bias"),
        **{name: Stacked([e[name] for e in experts]) for name in ("gate", "up", "down")},
    }
    if cfg.num_shared_experts:
        layer["mlp"]["shared"] = _swiglu(get, mlp + "shared_experts.")
    return layer


def _stack(layers: list[dict]) -> dict:
    return jax.tree.map(lambda *xs: Stacked(list(xs)), *layers)


def param_sources(sources: dict[str, Source], cfg: ModelConfig) -> dict:
    """Pure-dict model state (params and expert biases) as lazy sources over HF-named ones;
    nothing is read."""
    get = _Tensors(sources)
    state = {
        "embed": get("model.embed_tokens.weight"),
        "final_norm": {"scale": get("model.norm.weight")},
        "lm_head": _linear(get("lm_head.weight")),
    }
    if cfg.first_k_dense:
        state["dense_layers"] = _stack([_layer(get, i, cfg) for i in range(cfg.first_k_dense)])
    if cfg.num_moe_layers:
        state["moe_layers"] = _stack(
            [_layer(get, i, cfg) for i in range(cfg.first_k_dense, cfg.num_layers)]
        )
    mtp_prefixes = tuple(f"model.layers.{i}." for i in range(cfg.num_layers, cfg.num_layers + 8))
    unused = [
        n
        for n in get.unused()
        if not n.startswith(mtp_prefixes) and not n.endswith("rotary_emb.inv_freq")
    ]
    if unused:
        raise CheckpointMismatchError(
            f"checkpoint tensors the model has no place for: "
            f"{unused[:8]}{' ...' if len(unused) > 8 else ''}"
        )
    return state


def params_from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """Pure-dict model state as float32 numpy arrays from HF-named in-memory tensors."""
    sources = param_sources({k: ArraySource(v) for k, v in tensors.items()}, cfg)
    return jax.tree.map(lambda s: s.read(full_index(s.shape), np.float32), sources)


def _write_piece(shard: jax.Array, piece: jax.Array, offsets: tuple) -> jax.Array:
    return lax.dynamic_update_slice(shard, piece, offsets)


# Donated, so the shard is updated in place (no second copy of it, on CPU or GPU).
_write_piece_in_place = jax.jit(_write_piece, donate_argnums=0)


def _bounds(indices: list[tuple[slice, ...]]) -> tuple[slice, ...]:
    """The smallest region holding every index."""
    return tuple(
        slice(min(i[d].start for i in indices), max(i[d].stop for i in indices))
        for d in range(len(indices[0]))
    )


def _within(index: tuple[slice, ...], outer: tuple[slice, ...]) -> tuple[slice, ...]:
    """`index` relative to the region `outer`."""
    return tuple(slice(i.start - o.start, i.stop - o.start) for i, o in zip(index, outer))


def place(source: Source, shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding):
    """A global array of `source` with `sharding`, read by this process alone.

    The process reads the region its devices hold together once, piece by piece (one HF tensor's
    slice for a stacked parameter), and writes each device's part of every piece into that
    device's donated shard buffer: host memory holds one piece, the reads cover only this
    process's devices, and a shard several devices hold is read once and copied."""
    by_region: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        index = normalize(index, shape)
        by_region.setdefault(tuple((s.start, s.stop) for s in index), [index, []])[1].append(device)
    regions = list(by_region.values())
    bounds = _bounds([index for index, _ in regions])
    shards = {}
    for index, devices in regions:
        extent = tuple(s.stop - s.start for s in index)
        shards[devices[0]] = jnp.zeros(extent, dtype, device=devices[0])
    for offset, part, sub in pieces(source, bounds):
        piece = part.read(sub, dtype)
        position = tuple(b.start + o for b, o in zip(bounds, offset))
        for index, devices in regions:
            if not all(s.start <= p < s.stop for s, p in zip(index, position)):
                continue
            mine = piece[_within(index[len(offset) :], sub)]
            mine = jax.device_put(mine.reshape((1,) * len(offset) + mine.shape), devices[0])
            at = tuple(p - s.start for s, p in zip(index, position)) + (0,) * (
                mine.ndim - len(offset)
            )
            shards[devices[0]] = _write_piece_in_place(shards[devices[0]], mine, at)
    arrays = []
    for device in sharding.addressable_devices_indices_map(shape):
        owner = next(devices[0] for _, devices in regions if device in devices)
        arrays.append(shards[owner] if owner == device else jax.device_put(shards[owner], device))
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _flat(tree: dict) -> dict[str, object]:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _checked_sources(sources: dict, flat_expected: dict) -> dict:
    """`sources` keyed like `flat_expected`, after checking names and shapes."""
    flat_sources = _flat(sources)
    missing = sorted(set(flat_expected) - set(flat_sources))
    if missing:
        raise CheckpointMismatchError(f"model parameters not found in the checkpoint: {missing}")
    for key, spec in flat_expected.items():
        if tuple(flat_sources[key].shape) != tuple(spec.shape):
            raise CheckpointMismatchError(
                f"parameter {key}: checkpoint gives shape {tuple(flat_sources[key].shape)}, "
                f"the config implies {spec.shape}"
            )
    return flat_sources


def load_hf_checkpoint(
    path: str | os.PathLike,
    dtype: str = "float32",
    param_dtype: str = "float32",
    layout: Layout | None = None,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    progress: bool = False,
) -> Transformer:
    """A ready-to-run model from an HF DeepSeek-V3-format folder (config.json + safetensors, local
    or in a bucket), the architecture read from its config.json (`load_from_reader`)."""
    with CheckpointReader(path, buffer_bytes) as reader:
        return load_from_reader(reader, dtype, param_dtype, layout, progress)


def load_from_reader(
    reader: CheckpointReader,
    dtype: str = "float32",
    param_dtype: str = "float32",
    layout: Layout | None = None,
    progress: bool = False,
) -> Transformer:
    """Parameters read tensor slice by tensor slice straight into `param_dtype` and their sharding
    under `layout` (the default device without one): each process reads only what its devices
    hold, and host memory peaks near one tensor slice plus the reader's buffer. `progress` shows
    a bar over the parameters."""
    cfg = config_from_hf(reader.config, dtype=dtype, param_dtype=param_dtype)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
    expected = _flat(nnx.to_pure_dict(state))
    sources = _checked_sources(param_sources(hf_sources(reader), cfg), expected)
    if layout is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = dict.fromkeys(expected, device)
    else:
        shardings = _flat(nnx.to_pure_dict(layout.tree_shardings(logical_axes_of(state), state)))
    arrays = [
        place(sources[key], spec.shape, spec.dtype, shardings[key])
        for key, spec in tqdm(
            expected.items(), "loading", unit="param", disable=not progress, leave=False
        )
    ]
    loaded = jax.tree_util.tree_unflatten(jax.tree.structure(nnx.to_pure_dict(state)), arrays)
    nnx.replace_by_pure_dict(state, loaded)
    return nnx.merge(graphdef, state)
