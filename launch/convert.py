r"""Imports a Hugging Face DeepSeek-V3-format checkpoint, checks that it runs, and scores it.

  python -m launch.convert --hf_dir=path/to/hf [--eval_dir=path/to/code --window=256 --stride=128]
      [--prompt="def fib(n):" --max_new_tokens=32]

Prints the model config and parameter counts and runs one forward pass; with `--eval_dir`, the
perplexity of that code (files concatenated alphabetically, strided windows) under the
checkpoint's own tokenizer (the byte tokenizer if the folder has none); with `--prompt`, a greedy
continuation. Continued pretraining starts from such a checkpoint with
`launch.pretrain --config.init_from=path/to/hf`.
"""

import sys

from absl import flags

from launch import cli

_HF_DIR = flags.DEFINE_string(
    "hf_dir", None, "Folder with config.json and *.safetensors.", required=True
)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
_EVAL_DIR = flags.DEFINE_string("eval_dir", "", "Code to score (none: no perplexity).")
_WINDOW = flags.DEFINE_integer("window", 256, "Tokens per window.")
_STRIDE = flags.DEFINE_integer("stride", 128, "New tokens scored per window.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Windows per forward pass.")
_MAX_BYTES = flags.DEFINE_integer("max_bytes", 200_000, "Score only this many bytes (0: all).")
_PROMPT = flags.DEFINE_string("prompt", "", "Text to continue greedily (none: no generation).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Tokens generated after --prompt.")


def main(argv):
    del argv
    from launch import runtime

    runtime.initialize()
    import numpy as np

    from composer_jax import config as config_lib
    from composer_jax import data, infer, interop, model
    from composer_jax.eval import codebase_perplexity
    from composer_jax.model import accounting
    from composer_jax.train.runs import has_tokenizer_files

    try:
        m = interop.load_hf_checkpoint(_HF_DIR.value, dtype=_DTYPE.value)
        own = has_tokenizer_files(_HF_DIR.value)
        tokenizer = data.load_tokenizer(_HF_DIR.value if own else "byte")
        data.check_vocab(tokenizer, m.cfg.vocab_size, "the checkpoint's vocab_size")
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    counts = accounting.count_params(m.cfg)
    print(
        f"loaded {_HF_DIR.value}: {counts.total / 1e6:.1f}M parameters, "
        f"{counts.active / 1e6:.1f}M active"
    )
    print("model config:", config_lib.to_dict(m.cfg))
    print(
        f"tokenizer: {tokenizer.spec!r}{'' if own else ' (the folder has none)'}, "
        f"{tokenizer.vocab_size} ids, bos {tokenizer.bos_id}, eos {tokenizer.eos_id}"
    )
    tokens = np.random.default_rng(0).integers(0, m.cfg.vocab_size, (1, 16))
    logits = np.asarray(model.compute_logits(m, tokens))
    if not np.isfinite(logits).all():
        print("error: the checkpoint produces non-finite logits", file=sys.stderr)
        sys.exit(1)
    print(f"forward pass OK: logits {logits.shape}, mean {logits.mean():.4f}")
    if _EVAL_DIR.value:
        result = codebase_perplexity(
            lambda batch: model.compute_logits(m, batch),
            tokenizer,
            _EVAL_DIR.value,
            window=_WINDOW.value,
            stride=_STRIDE.value,
            batch_size=_BATCH.value,
            max_bytes=_MAX_BYTES.value or None,
            progress=True,
        )
        print(
            f"{_EVAL_DIR.value}: total NLL {result.total_nll:.1f} nats over {result.num_tokens} "
            f"tokens ({result.num_bytes} bytes); {result.bits_per_byte:.4f} bits/byte; "
            f"perplexity {result.perplexity:.3f}"
        )
    if _PROMPT.value:
        text = infer.generate(m, tokenizer, [_PROMPT.value], max_new_tokens=_MAX_NEW.value)[0]
        print(f"greedy continuation of {_PROMPT.value!r}: {text!r}")


if __name__ == "__main__":
    cli.run(main)
