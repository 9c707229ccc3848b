"""The `rl_small` preset: RL on the small model (one GPU)."""

from experiments.configs.common import preset_config_dict


def get_config():
    return preset_config_dict("rl_small")
