r"""Dense attention against attention in key blocks (`model.attention_block_size`), same run.

For each sequence length, the loss gradient of one row of `--preset`'s model (MTP off) is compiled
with each attention form; the table gives the compiled program's temporaries (XLA's own memory
analysis: what the step holds besides its arguments and outputs) and the median time of
`--repeats` calls after one warm-up, and each form's ratio to dense, the baseline, measured in the
same run. Gradients of the two forms agree within float32 rounding (tests/model/test_attention.py).

  PYTHONPATH=. python experiments/bench_attention.py [--lengths=128,512,2048,4096]
      [--blocks=256] [--dtype=float32] [--repeats=5] [--preset=tiny]
"""

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from composer_jax import config as config_lib
from composer_jax import presets
from composer_jax.model import init_model
from composer_jax.train import step as step_lib

_LENGTHS = flags.DEFINE_list("lengths", ["128", "512", "2048", "4096"], "Tokens in the row.")
_BLOCKS = flags.DEFINE_list("blocks", ["256"], "Keys per block of each key-block form.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per form (median).")
_PRESET = flags.DEFINE_string("preset", "tiny", "Preset whose model is measured.")


def loss_gradient(length: int, block: int | None):
    """(compiled gradient of the pretraining loss on one random row, its parameters)."""
    cfg = dataclasses.replace(
        presets.PRESETS[_PRESET.value]().model,
        dtype=_DTYPE.value,
        num_mtp_layers=0,
        attention_block_size=block,
    )
    graphdef, params, buffers = step_lib.split_model(init_model(cfg, seed=0))
    rng = np.random.default_rng(0)
    batch = {
        "tokens": jnp.asarray(rng.integers(0, cfg.vocab_size, (1, length)), jnp.int32),
        "segment_ids": jnp.ones((1, length), jnp.int32),
        "positions": jnp.arange(length, dtype=jnp.int32)[None],
    }

    def loss(p):
        model = nnx.merge(graphdef, p, buffers)
        return step_lib.pretrain_loss(model, batch, config_lib.TrainConfig())[0]

    return jax.jit(jax.grad(loss)).trace(params).lower().compile(), params


def measure(length: int, block: int | None) -> tuple[float, float]:
    """(compiled temporaries in MiB, median seconds of a call)."""
    compiled, params = loss_gradient(length, block)
    temporaries = compiled.memory_analysis().temp_size_in_bytes / 2**20
    jax.block_until_ready(compiled(params))
    times = []
    for _ in range(_REPEATS.value):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params))
        times.append(time.perf_counter() - start)
    return temporaries, statistics.median(times)


def main(argv):
    del argv
    forms = [("dense", None)] + [(f"blocks of {b}", int(b)) for b in _BLOCKS.value]
    print(f"{_PRESET.value} model, one row, loss gradient in {_DTYPE.value}; ratios to dense")
    print("| tokens | form | temporaries (MiB) | time (ms) | temporaries / dense | time / dense |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for length in map(int, _LENGTHS.value):
        dense = None
        for name, block in forms:
            memory, seconds = measure(length, block)
            dense = dense or (memory, seconds)
            print(
                f"| {length} | {name} | {memory:.1f} | {seconds * 1e3:.1f} "
                f"| {memory / dense[0]:.2f} | {seconds / dense[1]:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    app.run(main)
