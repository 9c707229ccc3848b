r"""Imports a Hugging Face DeepSeek-V3-format checkpoint and checks that it runs.

  python -m launch.convert --hf_dir=path/to/hf

Prints the model config and parameter counts, and runs one forward pass. Continued pretraining
starts from such a checkpoint with `launch.pretrain --config.init_from=path/to/hf`.
"""

import sys

from absl import flags

from launch import cli

_HF_DIR = flags.DEFINE_string(
    "hf_dir", None, "Folder with config.json and *.safetensors.", required=True
)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")


def main(argv):
    del argv
    from launch import runtime

    runtime.initialize()
    import numpy as np

    from composer_jax import config as config_lib
    from composer_jax import interop, model
    from composer_jax.model import accounting

    try:
        m = interop.load_hf_checkpoint(_HF_DIR.value, dtype=_DTYPE.value)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    counts = accounting.count_params(m.cfg)
    print(
        f"loaded {_HF_DIR.value}: {counts.total / 1e6:.1f}M parameters, "
        f"{counts.active / 1e6:.1f}M active"
    )
    print("model config:", config_lib.to_dict(m.cfg))
    tokens = np.random.default_rng(0).integers(0, m.cfg.vocab_size, (1, 16))
    logits = np.asarray(model.compute_logits(m, tokens))
    if not np.isfinite(logits).all():
        print("error: the checkpoint produces non-finite logits", file=sys.stderr)
        sys.exit(1)
    print(f"forward pass OK: logits {logits.shape}, mean {logits.mean():.4f}")


if __name__ == "__main__":
    cli.run(main)
