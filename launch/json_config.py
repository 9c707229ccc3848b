"""The config file behind `--config=FILE.json`: a whole config as JSON (what `--print_config`
prints, or what a sweep writes for a base given as a dict); ml_collections passes the path after
':' to `get_config`."""

import json

import ml_collections

from composer_jax import config as config_lib


def get_config(path: str) -> ml_collections.ConfigDict:
    """The JSON as a ConfigDict of the current layout (an older file's flat `rl` fields moved into
    their sections, with a warning), so `--config.<field>` overrides take today's paths."""
    with open(path) as f:
        data = json.load(f)
    return ml_collections.ConfigDict(
        config_lib.to_dict(config_lib.from_dict(config_lib.ExperimentConfig, data))
    )
