"""Starting a run from a Hugging Face checkpoint: the architecture read from its `config.json`
(`with_checkpoint_architecture`: no model field by hand), then the model of `init_from`, checked
to be the config's architecture (`train.loop.run_pretraining(cfg, pretrained=...)` copies its
tensors)."""

import dataclasses

from composer_jax import config as config_lib
from composer_jax.interop.hf import config_from_hf, load_hf_checkpoint
from composer_jax.interop.safetensors_io import read_hf_config
from composer_jax.model.transformer import Transformer
from composer_jax.parallel import Layout

# Fields that may differ between a pretrained checkpoint and the model trained from it.
FREE_FIELDS = frozenset(
    {
        "dtype",
        "param_dtype",
        "scan_layers",
        "remat",
        "attention_block_size",
        "num_mtp_layers",
        "router_bias_update_rate",
        "balance_loss_alpha",
        "max_position_embeddings",
        "replay_min_ratio",
        "expert_precision",
        "expert_backend",
        "expert_gemm_impl",
    }
)


def with_checkpoint_architecture(cfg: config_lib.ExperimentConfig) -> config_lib.ExperimentConfig:
    """`cfg` with the architecture of its `init_from` checkpoint (every model field but
    `FREE_FIELDS`, which stay the config's: numerics, execution, MTP heads trained from scratch);
    unchanged without `init_from`. A folder without a readable config.json, or one with settings
    the model cannot represent, is a ConfigError naming all of them."""
    if not cfg.init_from:
        return cfg
    try:
        hf = read_hf_config(cfg.init_from)
        free = {name: getattr(cfg.model, name) for name in FREE_FIELDS}
        model = config_from_hf(hf, **free)
    except FileNotFoundError:
        raise config_lib.ConfigError(
            f"init_from: {cfg.init_from!r} has no config.json (not a Hugging Face checkpoint)"
        ) from None
    except (ValueError, KeyError, TypeError) as error:
        raise config_lib.ConfigError(f"init_from: {cfg.init_from}: {error}") from None
    return dataclasses.replace(cfg, model=model)


def check_same_architecture(ours: config_lib.ModelConfig, theirs: config_lib.ModelConfig) -> None:
    """A ConfigError naming the first architecture field the two configs disagree on."""
    for field in dataclasses.fields(ours):
        if field.name in FREE_FIELDS:
            continue
        a, b = getattr(ours, field.name), getattr(theirs, field.name)
        if a != b:
            raise config_lib.ConfigError(
                f"model.{field.name}: the config has {a!r} but the init_from checkpoint has {b!r}"
            )


def load_pretrained(cfg: config_lib.ExperimentConfig, layout: Layout | None = None) -> Transformer:
    """The `cfg.init_from` checkpoint as a model in cfg's numerics, after the architecture
    check; under `layout` (the run's), each process reads and places only its devices' slices
    (a model of a real size does not fit one device)."""
    model = load_hf_checkpoint(
        cfg.init_from, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype, layout=layout
    )
    check_same_architecture(cfg.model, model.cfg)
    return model
