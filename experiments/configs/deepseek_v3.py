"""The `deepseek_v3` preset (composer_jax/presets.py); override fields with --config.<field>=<value>."""

from launch.preset_config import preset_config_dict


def get_config():
    return preset_config_dict("deepseek_v3")
