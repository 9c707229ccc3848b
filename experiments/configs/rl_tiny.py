"""The `rl_tiny` preset: the main job of `launch/rl.py` (tiny model, CPU, built-in tasks)."""

from experiments.configs.common import preset_config_dict


def get_config():
    return preset_config_dict("rl_tiny")
