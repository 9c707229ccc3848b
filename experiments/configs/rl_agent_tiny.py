"""The `rl_agent_tiny` preset: the multi-turn coding agent in small repositories."""

from launch.preset_config import preset_config_dict


def get_config():
    return preset_config_dict("rl_agent_tiny")
