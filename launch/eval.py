r"""Codebase perplexity of a trained run (the report's base-model metric).

  python -m launch.eval --config.workdir=runs/tiny [--eval_dir=path/to/code] [--window=256 --stride=128]

Concatenates the directory's source files in alphabetical order and scores them with rolling
windows under the run's tokenizer; prints total NLL, bits per byte and perplexity. Defaults to the
standard library.
"""

import os
import sys

from absl import flags

from launch import cli, malloc

_RUN = cli.define_run_folder("A pretraining run's folder.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_EVAL_DIR = flags.DEFINE_string("eval_dir", "", "Code to score (default: the standard library).")
_WINDOW = flags.DEFINE_integer("window", 256, "Tokens per window.", lower_bound=1)
_STRIDE = flags.DEFINE_integer("stride", 128, "New tokens scored per window.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 8, "Windows per forward pass.", lower_bound=1)
_MAX_BYTES = flags.DEFINE_integer(
    "max_bytes", 200_000, "Score only this many bytes (0: all).", lower_bound=0
)
# Checked at parsing: the model loads (minutes at scale) before the text is read.
flags.register_validator("eval_dir", lambda path: not path or os.path.isdir(path), "no such folder")
flags.register_multi_flags_validator(
    ["stride", "window"],
    lambda values: values["stride"] <= values["window"],
    "--stride must be at most --window (a window scores its last --stride tokens)",
)


def main(argv):
    del argv
    workdir = _RUN() or cli.fail("--config.workdir: the run's folder is required")
    from launch import runtime

    runtime.initialize()
    from composer_jax import config as config_lib
    from composer_jax import data, model
    from composer_jax.eval import codebase_perplexity
    from composer_jax.train import CheckpointError
    from composer_jax.train.loop import load_trained_model
    from composer_jax.train.runs import run_tokenizer

    try:
        m, step = load_trained_model(workdir, _STEP.value)
        tokenizer = run_tokenizer(workdir)
    except (CheckpointError, config_lib.ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    root = _EVAL_DIR.value or data.default_code_root()
    result = codebase_perplexity(
        lambda tokens: model.compute_logits(m, tokens),
        tokenizer,
        root,
        window=_WINDOW.value,
        stride=_STRIDE.value,
        batch_size=_BATCH.value,
        max_bytes=_MAX_BYTES.value or None,
        progress=True,
    )
    print(
        f"{workdir} step {step} on {root}: total NLL {result.total_nll:.1f} nats over "
        f"{result.num_tokens} tokens ({result.num_bytes} bytes); {result.bits_per_byte:.4f} "
        f"bits/byte; perplexity {result.perplexity:.3f}"
    )


if __name__ == "__main__":
    malloc.exec_with_tunables()
    cli.run(main)
