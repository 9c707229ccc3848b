"""Checkpoint import from and export to the Hugging Face DeepSeek-V3 / Kimi-K2 format (the
tokenizer of such a folder loads with `composer_jax.data.load_tokenizer(folder)`)."""

from composer_jax.interop.export import export_hf_checkpoint
from composer_jax.interop.hf import (
    CheckpointMismatchError,
    config_from_hf,
    load_hf_checkpoint,
    params_from_hf,
)
from composer_jax.interop.init import (
    check_same_architecture,
    load_pretrained,
    with_checkpoint_architecture,
)
from composer_jax.interop.safetensors_io import read_hf_checkpoint

__all__ = [
    "check_same_architecture",
    "load_pretrained",
    "CheckpointMismatchError",
    "export_hf_checkpoint",
    "config_from_hf",
    "load_hf_checkpoint",
    "params_from_hf",
    "read_hf_checkpoint",
    "with_checkpoint_architecture",
]
