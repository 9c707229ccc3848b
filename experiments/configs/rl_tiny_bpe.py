"""The `rl_tiny_bpe` preset: the RL main job on the shipped 2048-id BPE tokenizer."""

from launch.preset_config import preset_config_dict


def get_config():
    return preset_config_dict("rl_tiny_bpe")
