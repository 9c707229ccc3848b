r"""Asynchronous RL on coding environments: the project's main job.

  python -m launch.rl                                  # tiny model, CPU, built-in tasks, minutes
  python -m launch.rl --config.rl.backend=ray          # sampler and environments as Ray actors
  python -m launch.rl --config.rl.warm_start=runs/tiny # start from a launch.pretrain run

On the embedded default it warm-starts the tiny model with a short SFT on the built-in tasks,
measures the mean reward on held-out tasks, runs asynchronous RL, measures it again and prints both
with confidence intervals. Starting again with the same workdir resumes.
"""

import sys

from absl import flags

from launch import cli

_CONFIG = cli.define_config("rl_tiny")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show progress bars.")


def main(argv):
    del argv
    from launch import runtime

    runtime.initialize()
    from composer_jax import config as config_lib
    from composer_jax.actor.run import exit_code, run_rl
    from composer_jax.actor.trainer import NonFiniteRLLossError
    from composer_jax.train import CheckpointError, NonFiniteLossError

    try:
        cfg = config_lib.from_dict(config_lib.ExperimentConfig, _CONFIG.value)
        if cfg.rl.backend == "ray":
            runtime.initialize_ray()
        result = run_rl(cfg, progress=_PROGRESS.value)
    except (
        config_lib.ConfigError,
        NonFiniteLossError,
        NonFiniteRLLossError,
        CheckpointError,
    ) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(exit_code(result))


if __name__ == "__main__":
    cli.run(main)
