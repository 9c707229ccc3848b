r"""Train-step throughput and compile time of the tiny model at 2, 4 and 8 layers.

Scanned layers (the default) against the same model unrolled, measured in the same run: the scanned
compile time should stay roughly flat in depth while the unrolled one grows.

  python experiments/bench_pretrain_step.py [--layers=2,4,8] [--steps=20] [--plot=bench.png]
"""

import dataclasses
import functools
import time

from absl import app, flags

_LAYERS = flags.DEFINE_list("layers", ["2", "4", "8"], "Depths to measure.")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps per configuration (after one warm-up).")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step.")
_SEQ = flags.DEFINE_integer("seq_len", 128, "Tokens per sequence.")
_PLOT = flags.DEFINE_string("plot", "", "If set, save a compile-time plot to this PNG path.")


def measure(model_cfg, batch_size: int, seq_len: int, steps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from composer_jax import config as config_lib
    from composer_jax import optim
    from composer_jax.model import init_model
    from composer_jax.model.layers import logical_axes_of
    from composer_jax.train import step as step_lib

    schedule = optim.learning_rate_schedule(config_lib.OptimizerConfig(), 1000)
    m = init_model(model_cfg, seed=0)
    graphdef, params, _ = step_lib.split_model(m)
    optimizer = optim.make_optimizer(
        config_lib.OptimizerConfig(), schedule, logical_axes_of(params), verbose=False
    )
    state = step_lib.init_train_state(m, optimizer)
    rng = np.random.default_rng(0)
    batch = {
        "tokens": jnp.asarray(rng.integers(0, 256, (batch_size, seq_len)), jnp.int32),
        "segment_ids": jnp.ones((batch_size, seq_len), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch_size, seq_len)),
    }
    step = jax.jit(
        functools.partial(
            step_lib.train_step,
            graphdef,
            optimizer,
            model_cfg,
            config_lib.TrainConfig(),
            schedule,
            None,  # one device: no layout
        ),
        donate_argnums=0,
    )
    t0 = time.perf_counter()
    compiled = step.trace(state, batch).lower().compile()
    compile_s = time.perf_counter() - t0
    state, metrics = compiled(state, batch)  # Warm-up.
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    elapsed = time.perf_counter() - t0
    return {
        "compile_s": compile_s,
        "tokens_per_s": steps * batch_size * seq_len / elapsed,
        "step_ms": 1e3 * elapsed / steps,
    }


def main(argv):
    del argv
    import jax

    from composer_jax import presets

    base = presets.tiny().model
    layers = [int(x) for x in _LAYERS.value]
    rows = []
    print(
        f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, batch {_BATCH.value} x "
        f"seq {_SEQ.value}, {_STEPS.value} timed steps"
    )
    print(
        f"{'layers':>6} {'mode':>8} {'compile s':>10} {'step ms':>9} {'tokens/s':>10} "
        f"{'compile / scan@' + str(layers[0]):>16}"
    )
    for n in layers:
        for scan in (True, False):
            cfg = dataclasses.replace(base, num_layers=n, scan_layers=scan)
            r = measure(cfg, _BATCH.value, _SEQ.value, _STEPS.value)
            rows.append({"layers": n, "scan": scan, **r})
            ref = next(x for x in rows if x["scan"] and x["layers"] == layers[0])
            print(
                f"{n:>6} {'scan' if scan else 'unrolled':>8} {r['compile_s']:>10.2f} "
                f"{r['step_ms']:>9.1f} {r['tokens_per_s']:>10.0f} "
                f"{r['compile_s'] / ref['compile_s']:>16.2f}",
                flush=True,
            )
    if _PLOT.value:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        for scan in (True, False):
            pts = [r for r in rows if r["scan"] == scan]
            ax.plot(
                [r["layers"] for r in pts],
                [r["compile_s"] for r in pts],
                "o-",
                label="scanned" if scan else "unrolled",
            )
        ax.set_xlabel("layers")
        ax.set_ylabel("train-step compile time (s)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(_PLOT.value, dpi=120)
        print(f"saved {_PLOT.value}")


if __name__ == "__main__":
    app.run(main)
