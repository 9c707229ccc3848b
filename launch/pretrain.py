r"""Continued pretraining on code.

  python -m launch.pretrain --config=experiments/configs/tiny.py \
      --config.steps=300 --config.workdir=runs/tiny

Starting again with the same workdir resumes from its latest checkpoint.
"""

import os
import signal
import sys

from absl import app, flags
from ml_collections import config_flags

_DEFAULT_CONFIG = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "configs", "tiny.py"
)
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "Experiment config file.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")


def main(argv):
    del argv
    from launch import runtime

    runtime.initialize()
    from composer_jax import config as config_lib
    from composer_jax.train import CheckpointError, NonFiniteLossError, run_pretraining

    try:
        cfg = config_lib.from_dict(config_lib.ExperimentConfig, _CONFIG.value)
        result = run_pretraining(cfg, progress=_PROGRESS.value)
    except (config_lib.ConfigError, NonFiniteLossError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if result.interrupted:
        sys.exit(128 + int(getattr(signal, result.interrupted)))  # The shell's convention.


if __name__ == "__main__":
    app.run(main)
