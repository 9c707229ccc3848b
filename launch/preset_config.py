"""The config file behind `--config=NAME`: a preset by name, so the entry points work from any
folder (ml_collections passes the text after ':' in `--config=FILE:NAME` to `get_config`)."""

import ml_collections

from composer_jax import config as config_lib
from composer_jax import presets


def preset_config_dict(name: str) -> ml_collections.ConfigDict:
    """A typed preset as the ConfigDict that `config_flags` overrides field by field."""
    if name not in presets.PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(sorted(presets.PRESETS))}")
    return ml_collections.ConfigDict(config_lib.to_dict(presets.PRESETS[name]()))


def get_config(name: str) -> ml_collections.ConfigDict:
    return preset_config_dict(name)
