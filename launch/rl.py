r"""Asynchronous RL on coding environments: the project's main job.

  python -m launch.rl                                  # tiny model, CPU, built-in tasks, minutes
  python -m launch.rl --config.rl.rollout.backend=ray          # sampler and environments as Ray actors
  python -m launch.rl --config.rl.warm_start=runs/tiny # start from a launch.pretrain run

On the embedded default it warm-starts the tiny model with a short SFT on the built-in tasks,
measures the mean reward on held-out tasks, runs asynchronous RL, measures it again and prints both
with confidence intervals. Starting again with the same workdir resumes. `--print_config` prints
the resolved config and exits; `--noprogress` prints a plain line every `--log_every_s` seconds.
"""

import os
import sys

from launch import cli, malloc, plain_log

_CONFIG = cli.define_config("rl_tiny")
_PROGRESS, _LOG_EVERY_S = plain_log.define_flags()


def _metrics_files(cfg) -> list:
    """The warm start's metrics (unless it is given) and the RL run's."""
    files = []
    if not cfg.rl.warm_start:
        warm = os.path.join(cfg.workdir, "warm_start", "metrics.jsonl")
        files.append(("warm start", warm, cfg.rl.warm_start_steps))
    return files + [("rl", os.path.join(cfg.workdir, "metrics.jsonl"), cfg.steps)]


def main(argv):
    del argv
    cfg = cli.experiment_config(_CONFIG)
    from launch import runtime

    runtime.initialize()
    from composer_jax import config as config_lib
    from composer_jax.actor.ray_backend import RayPlacementError
    from composer_jax.actor.run import exit_code, run_rl
    from composer_jax.actor.trainer import NonFiniteRLLossError, ProcessZeroFailed
    from composer_jax.train import CheckpointError, NonFiniteLossError

    try:
        if cfg.rl.rollout.backend == "ray":
            runtime.initialize_ray()
        with plain_log.progress_context(_metrics_files(cfg), _PROGRESS.value, _LOG_EVERY_S.value):
            result = run_rl(cfg, progress=_PROGRESS.value)
    except (config_lib.ConfigError, CheckpointError, ProcessZeroFailed) as e:
        cli.fail(str(e))  # bad input (process 0's, for the other processes)
    except (NonFiniteLossError, NonFiniteRLLossError, RayPlacementError) as e:
        cli.fail(str(e), status=1)
    sys.exit(exit_code(result))


if __name__ == "__main__":
    malloc.exec_with_tunables()
    cli.run(main)
