"""Turns a typed preset into the ml_collections.ConfigDict that `config_flags` overrides."""

import ml_collections

from composer_jax import config as config_lib


def preset_config_dict(name: str) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(config_lib.to_dict(config_lib.PRESETS[name]()))
