"""The config file behind `--config=FILE.json`: a whole config as JSON (what `--print_config`
prints, or what a sweep writes for a base given as a dict); ml_collections passes the path after
':' to `get_config`."""

import json

import ml_collections


def get_config(path: str) -> ml_collections.ConfigDict:
    with open(path) as f:
        return ml_collections.ConfigDict(json.load(f))
