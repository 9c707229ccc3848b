r"""Exports a run to a Hugging Face DeepSeek-V3-format folder that `transformers` loads.

  python -m launch.export --config.workdir=runs/tiny --out=exported/tiny [--step=N] \
      [--dtype=bfloat16] [--shard_size_mb=5120]

Writes config.json, model.safetensors (float32; MTP heads are not part of the format), the run's
tokenizer files and generation_config.json. `launch.convert --hf_dir=OUT` checks the result here.
"""

from absl import flags

from composer_jax.config import ConfigError
from launch import cli

_RUN = cli.define_run_folder("A training run's folder.")
_OUT = flags.DEFINE_string("out", None, "Folder to write the HF checkpoint into.", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_DTYPE = flags.DEFINE_enum(
    "dtype",
    "float32",
    ["float32", "bfloat16", "fp8"],
    "Weights' dtype (float32: the exact inverse; fp8: DeepSeek-V3 128x128-block e4m3 linears).",
)
_SHARD_MB = flags.DEFINE_integer(
    "shard_size_mb",
    5120,
    "Largest weight shard (one model.safetensors when all fit).",
    lower_bound=1,
)


def refuse_an_occupied_folder(out) -> None:
    """An export goes into a new or empty folder: files left by another (an index of older
    shards beside a new single file, a run's own config) would load in its place. Checked by
    every process, before any writes (a barrier follows on several processes)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "holds files" if out.is_dir() else "is a file"
        raise ConfigError(f"--out: {out} {what}; export into a new or empty folder")


def main(argv):
    del argv
    workdir = _RUN() or cli.fail("--config.workdir: the run's folder is required")
    from launch import runtime

    runtime.initialize()
    import jax
    from jax.experimental import multihost_utils

    from composer_jax import config as config_lib
    from composer_jax import interop
    from composer_jax.data import TokenizerError
    from composer_jax.train import CheckpointError, load_run
    from composer_jax.train.workdir import run_path

    try:
        out = run_path(_OUT.value, "--out")  # a bucket needs its client before anything runs
        refuse_an_occupied_folder(out)
        if jax.process_count() > 1:  # no process writes before every one has checked
            multihost_utils.sync_global_devices("export: --out checked")
        run = load_run(workdir, _STEP.value)
        interop.export_hf_checkpoint(
            run.model, str(out), run.tokenizer, _DTYPE.value, _SHARD_MB.value << 20
        )
    except (CheckpointError, config_lib.ConfigError, TokenizerError, OSError) as e:
        cli.fail(str(e))
    print(
        f"exported {workdir} step {run.step} with tokenizer {run.tokenizer.spec!r} "
        f"({run.tokenizer.vocab_size} ids) to {_OUT.value}"
    )


if __name__ == "__main__":
    cli.run(main)
