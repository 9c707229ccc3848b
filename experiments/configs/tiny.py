"""The `tiny` preset (see composer_jax/config.py); override fields with --config.<field>=<value>."""

from experiments.configs.common import preset_config_dict


def get_config():
    return preset_config_dict("tiny")
