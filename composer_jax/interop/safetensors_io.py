"""Torch-free reading of Hugging Face DeepSeek-V3-format checkpoints (DeepSeek-V3, Kimi-K2).

Everything comes back as numpy arrays under HF's tensor names, with DeepSeek's fp8 block
quantization undone and the experts in one layout, so the mapping into model parameters handles a
single form whichever tool wrote the checkpoint.
"""

import dataclasses
import json
import math
import pathlib
import re

import ml_dtypes
import numpy as np
from etils import epath

INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
DEFAULT_FP8_BLOCK = (128, 128)

# safetensors dtype names -> numpy dtypes; ml_dtypes supplies the ones numpy lacks.
DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")


def read_hf_config(path) -> dict:
    """Reads `config.json` from a checkpoint folder, with the RoPE settings in one form.

    Hub configs (DeepSeek-V3, Kimi-K2) carry top-level `rope_theta` and `rope_scaling` (key "type");
    transformers >= 5 writes both into `rope_parameters` (key "rope_type"). Either way the result has
    `rope_theta` and `rope_scaling`: None for plain RoPE, else a dict with "rope_type".
    """
    config = json.loads((epath.Path(path) / "config.json").read_text())
    params = dict(config.pop("rope_parameters", None) or {})
    scaling = dict(config.get("rope_scaling") or params)
    theta = config.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ValueError(
            "config.json: rope_theta is missing (neither top-level nor in rope_parameters)"
        )
    config["rope_theta"] = float(theta)
    scaling.pop("rope_theta", None)
    legacy_type = scaling.pop("type", None)
    rope_type = scaling.setdefault("rope_type", legacy_type or "default")
    if legacy_type is not None and legacy_type != rope_type:
        raise ValueError(
            f"config.json: rope_scaling type {legacy_type!r} contradicts rope_type {rope_type!r}"
        )
    config["rope_scaling"] = None if rope_type == "default" else scaling
    return config


def read_hf_tensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint folder, as read-only memory maps (nothing is read until used).

    Reads the shards listed in `model.safetensors.index.json` when there is one, else every
    `*.safetensors` file in the folder. Dtypes are kept as stored (bf16 and fp8 via ml_dtypes).
    """
    folder = pathlib.Path(path)
    index_path = folder / INDEX_FILE
    weight_map = json.loads(index_path.read_text())["weight_map"] if index_path.exists() else None
    files = (
        sorted(set(weight_map.values()))
        if weight_map
        else sorted(p.name for p in folder.glob("*.safetensors"))
    )
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    tensors, source = {}, {}
    for file in files:
        for name, array in read_safetensors_file(folder / file).items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} is in both {source[name]} and {file}")
            tensors[name], source[name] = array, file
    for name, file in (weight_map or {}).items():
        if source.get(name) != file:
            raise ValueError(
                f"{INDEX_FILE} puts tensor {name!r} in {file}, found in {source.get(name)}"
            )
    return tensors


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: `file`, from absolute byte `start`, `nbytes` long."""

    name: str
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def read_header(f, file_name: str, file_size: int) -> dict[str, TensorEntry]:
    """The tensors of one open safetensors file, checked against its size: a truncated shard or
    an unsupported dtype is a one-line error naming the tensor and the file."""
    header_len = int.from_bytes(f.read(8), "little")
    if not 0 < header_len <= file_size - 8:
        raise ValueError(f"{file_name}: not a safetensors file (header of {header_len} bytes)")
    header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    data_len = file_size - data_start
    entries = {}
    for name, info in header.items():
        dtype = DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{file_name}: tensor {name!r} has unsupported dtype {info['dtype']}")
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        expected = math.prod(shape) * np.dtype(dtype).itemsize
        if end - begin != expected or not 0 <= begin <= end <= data_len:
            raise ValueError(
                f"{file_name}: tensor {name!r} has bytes [{begin}, {end}) of a {data_len}-byte "
                f"data section, but {info['dtype']}{list(shape)} needs {expected} "
                "(a truncated or corrupt shard)"
            )
        entries[name] = TensorEntry(
            name, file_name, np.dtype(dtype), shape, data_start + begin, expected
        )
    return entries


def read_safetensors_file(file: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of one file as a read-only memory map (safetensors' numpy loader cannot
    return fp8)."""
    with open(file, "rb") as f:
        entries = read_header(f, file.name, file.stat().st_size)
    data = np.memmap(file, np.uint8, mode="r") if entries else None
    return {
        name: data[e.start : e.start + e.nbytes].view(e.dtype).reshape(e.shape)
        for name, e in entries.items()
    }


def dequantize_fp8_blocks(
    weight_fp8, scale_inv, block=DEFAULT_FP8_BLOCK, name="weight"
) -> np.ndarray:
    """DeepSeek-V3 block dequantization: w[i, j] = fp8[i, j] * scale_inv[i // block[0], j // block[1]].

    Blocks are fixed-size from the top-left corner, so the last row and column of blocks may be
    partial; `scale_inv` is [ceil(rows / block[0]), ceil(cols / block[1])]. `name` labels errors.
    """
    if weight_fp8.dtype not in FP8_DTYPES or weight_fp8.ndim != 2:
        raise ValueError(
            f"{name}: expected a 2-D float8 weight, got {weight_fp8.dtype}{list(weight_fp8.shape)}"
        )
    rows, cols = weight_fp8.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if scale_inv.shape != expected:
        raise ValueError(
            f"{name}{SCALE_SUFFIX}: shape {list(scale_inv.shape)}, but a {rows}x{cols} weight in "
            f"{block[0]}x{block[1]} blocks needs {list(expected)}"
        )
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)
    return weight_fp8.astype(np.float32) * scale[:rows, :cols]


def dequantize_fp8_tensors(tensors, block=DEFAULT_FP8_BLOCK) -> dict[str, np.ndarray]:
    """Replaces every `X` that has an `X_scale_inv` by its float32 dequantization; drops the scales."""
    out = {}
    for name, array in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in tensors:
                raise ValueError(
                    f"scale {name!r} has no weight {name.removesuffix(SCALE_SUFFIX)!r}"
                )
            continue
        scale_inv = tensors.get(name + SCALE_SUFFIX)
        if scale_inv is not None:
            out[name] = dequantize_fp8_blocks(array, scale_inv, block, name=name)
        elif array.dtype in FP8_DTYPES:
            raise ValueError(f"tensor {name!r} is {array.dtype} but has no {name + SCALE_SUFFIX!r}")
        else:
            out[name] = array
    return out


def normalize_expert_layout(tensors, num_layers) -> dict[str, np.ndarray]:
    """Rewrites fused routed experts into the per-expert layout of hub checkpoints.

    transformers >= 5 holds (and can write) `model.layers.{l}.mlp.experts.gate_up_proj` [E, 2F, D],
    gate rows before up rows, and `...experts.down_proj` [E, D, F]. They become
    `model.layers.{l}.mlp.experts.{i}.{gate,up,down}_proj.weight`, each [out, in] like nn.Linear.
    Per-expert tensors pass through unchanged.
    """
    out = dict(tensors)
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up, down = out.pop(prefix + "gate_up_proj", None), out.pop(prefix + "down_proj", None)
        if gate_up is None and down is None:
            continue
        if gate_up is None or down is None:
            present = "gate_up_proj" if down is None else "down_proj"
            raise ValueError(f"{prefix}{present} has no fused partner")
        num_experts, two_f, hidden = gate_up.shape if gate_up.ndim == 3 else (-1, -1, -1)
        if two_f < 0 or two_f % 2 or down.shape != (num_experts, hidden, two_f // 2):
            raise ValueError(
                f"{prefix}gate_up_proj {list(gate_up.shape)} and {prefix}down_proj {list(down.shape)} "
                "are not [E, 2F, D] and [E, D, F]"
            )
        f = two_f // 2
        for i in range(num_experts):
            split = {"gate_proj": gate_up[i, :f], "up_proj": gate_up[i, f:], "down_proj": down[i]}
            for kind, value in split.items():
                key = f"{prefix}{i}.{kind}.weight"
                if key in out:
                    raise ValueError(f"{key!r} exists in both the fused and the per-expert layout")
                out[key] = value
    leftover = sorted(k for k in out if _FUSED_EXPERTS.search(k))
    if leftover:
        raise ValueError(
            f"fused expert tensor {leftover[0]!r} is outside layers 0..{num_layers - 1}"
        )
    return out


def read_hf_checkpoint(path) -> tuple[dict, dict[str, np.ndarray]]:
    """Config plus tensors, dequantized and per expert: the one form weight mapping needs to handle.

    Layer count includes DeepSeek-V3's MTP layers (`num_nextn_predict_layers`), stored after the
    decoder layers.
    """
    config = read_hf_config(path)
    quant = config.get("quantization_config") or {}
    if quant and quant.get("quant_method") != "fp8":
        raise ValueError(
            f"config.json: quantization_config.quant_method {quant.get('quant_method')!r} is not 'fp8'"
        )
    block = tuple(quant.get("weight_block_size", DEFAULT_FP8_BLOCK))
    tensors = dequantize_fp8_tensors(read_hf_tensors(path), block)
    num_layers = config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0)
    return config, normalize_expert_layout(tensors, num_layers)
