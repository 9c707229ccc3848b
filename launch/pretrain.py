r"""Continued pretraining on code.

  python -m launch.pretrain [--config=tiny] --config.steps=300 --config.workdir=runs/tiny

Starting again with the same workdir resumes from its latest checkpoint. `--print_config` prints
the resolved config and exits; `--noprogress` prints a plain line every `--log_every_s` seconds.
"""

import functools
import os
import signal
import sys

from launch import cli, malloc, plain_log

_CONFIG = cli.define_config("tiny")
_PROGRESS, _LOG_EVERY_S = plain_log.define_flags()


def main(argv):
    del argv
    cfg = cli.experiment_config(_CONFIG)
    from launch import runtime

    runtime.initialize()
    import jax

    from composer_jax import agent, interop
    from composer_jax import config as config_lib
    from composer_jax.train import CheckpointError, NonFiniteLossError, run_pretraining

    metrics = [("pretrain", os.path.join(cfg.workdir, "metrics.jsonl"), cfg.steps)]
    no_plain_lines = _PROGRESS.value or jax.process_index() > 0  # process 0 reports for all
    try:
        with plain_log.progress_context(metrics, no_plain_lines, _LOG_EVERY_S.value):
            result = run_pretraining(
                cfg,
                progress=_PROGRESS.value,
                pretrained=functools.partial(interop.load_pretrained, cfg),
                sft_examples=agent.sft_examples(cfg),
            )
    except (config_lib.ConfigError, CheckpointError) as e:
        cli.fail(str(e))
    except NonFiniteLossError as e:
        cli.fail(str(e), status=1)
    if result.interrupted:
        sys.exit(128 + int(getattr(signal, result.interrupted)))  # The shell's convention.


if __name__ == "__main__":
    malloc.exec_with_tunables()
    cli.run(main)
