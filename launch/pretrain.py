r"""Continued pretraining on code.

  python -m launch.pretrain [--config=tiny] --config.steps=300 --config.workdir=runs/tiny

Starting again with the same workdir resumes from its latest checkpoint.
"""

import signal
import sys

from absl import flags

from launch import cli

_CONFIG = cli.define_config("tiny")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")


def main(argv):
    del argv
    from launch import runtime

    runtime.initialize()
    from composer_jax import config as config_lib
    from composer_jax import interop
    from composer_jax.train import CheckpointError, NonFiniteLossError, run_pretraining

    try:
        cfg = config_lib.from_dict(config_lib.ExperimentConfig, _CONFIG.value)
        result = run_pretraining(
            cfg, progress=_PROGRESS.value, pretrained=lambda: interop.load_pretrained(cfg)
        )
    except (config_lib.ConfigError, NonFiniteLossError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if result.interrupted:
        sys.exit(128 + int(getattr(signal, result.interrupted)))  # The shell's convention.


if __name__ == "__main__":
    cli.run(main)
