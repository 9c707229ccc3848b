r"""Per-device state bytes and per-step collective bytes of each (replica, fsdp, cp) layout.

Compiles (does not run) the train step of the tiny and small presets on 8 simulated devices and
reads the compiled HLO: dense-parameter, expert-parameter and Adam bytes held by each device, and
bytes produced per device by all-gather, reduce-scatter, all-reduce and all-to-all in one step.
Dense state shards over fsdp*cp (the last column stays constant when it shrinks linearly); expert
state shards over all 8 devices in every layout (EP group x expert-FSDP on the other axes).

  python experiments/bench_parallel.py [--presets=tiny,small] [--seq_len=256]
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402

_PRESETS = flags.DEFINE_list("presets", ["tiny", "small"], "Presets to measure.")
_SEQ = flags.DEFINE_integer("seq_len", 256, "Tokens per sequence.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step (divisible by replica*fsdp).")
LAYOUTS = [(1, 8, 1), (2, 4, 1), (1, 4, 2), (2, 2, 2)]


def measure(preset: str, shape, seq_len: int, batch: int) -> dict:
    import jax

    from composer_jax import config as config_lib
    from composer_jax import presets
    from composer_jax.parallel import make_layout
    from composer_jax.parallel.report import bytes_per_device, collective_bytes
    from composer_jax.train import loop

    replica, fsdp, cp = shape
    cfg = presets.PRESETS[preset]()
    cfg = dataclasses.replace(cfg, mesh=config_lib.MeshConfig(replica=replica, fsdp=fsdp, cp=cp))
    layout = make_layout(cfg.mesh)
    setup = loop.make_train_setup(cfg, layout)
    state = setup.abstract_state
    tokens = jax.ShapeDtypeStruct(
        (batch, seq_len), jax.numpy.int32, sharding=layout.batch_sharding()
    )
    batch_spec = {"tokens": tokens, "segment_ids": tokens, "positions": tokens}
    fn = setup.jit_train_step(donate=False)
    t0 = time.perf_counter()
    compiled = fn.trace(state, batch_spec).lower().compile()
    seconds = time.perf_counter() - t0
    comms = collective_bytes(compiled.as_text())
    experts = {k: state.params["moe_layers"]["mlp"][k] for k in ("gate", "up", "down")}
    return {
        "params": bytes_per_device(state.params),
        "experts": bytes_per_device(experts),
        "opt": bytes_per_device(state.opt_state),
        "comms": comms,
        "compile_s": seconds,
    }


def main(argv):
    del argv
    kinds = ["all-gather", "reduce-scatter", "all-reduce", "all-to-all"]
    for preset in _PRESETS.value:
        print(f"\n{preset}: batch {_BATCH.value} x seq {_SEQ.value}, 8 devices (MiB per device)")
        header = (
            f"{'layout (r,f,c)':>15} {'dense':>8} {'experts':>8} {'adam':>8} "
            + " ".join(f"{k:>14}" for k in kinds)
            + f" {'dense x fsdp*cp':>16}"
        )
        print(header)
        for shape in LAYOUTS:
            r = measure(preset, shape, _SEQ.value, _BATCH.value)
            mib = lambda b: b / 2**20  # noqa: E731
            dense_shards = shape[1] * shape[2]
            dense = r["params"] - r["experts"]
            print(
                f"{str(shape):>15} {mib(dense):>8.2f} {mib(r['experts']):>8.2f} "
                f"{mib(r['opt']):>8.2f} "
                + " ".join(f"{mib(r['comms'].get(k, 0)):>14.2f}" for k in kinds)
                + f" {mib(dense) * dense_shards:>16.2f}",
                flush=True,
            )


if __name__ == "__main__":
    app.run(main)
