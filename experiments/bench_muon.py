r"""Sharded Muon: optimizer step time and collective bytes, all-gather vs all-to-all Newton-Schulz.

The small preset on 8 simulated CPU devices. Collective bytes come from the compiled HLO of one
optimizer update (clip + Muon + AdamW) on the full small preset (compiled from abstract arrays,
nothing allocated); step time is measured on the same widths at `--time_layers` depth, since the
all-gather baseline does 8x the Newton-Schulz work and the full depth takes minutes per step on a
couple of CPU cores. Also prints where the collectives sit in the scheduled HLO.

Bytes are what each collective produces per device. A matrix block of L bytes sharded k ways costs
the all-gather k * L (every device then runs Newton-Schulz on the whole matrix) and the two
all-to-alls 2 * L (each device orthogonalises 1/k of the batch): k / 2 times fewer bytes, the same
at k = 2, where the all-to-all still halves the Newton-Schulz work.

  python experiments/bench_muon.py [--layout=1,8,1] [--time_layers=2] [--steps=3]
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402

_LAYOUT = flags.DEFINE_list("layout", ["1", "8", "1"], "Mesh (replica, fsdp, cp).")
_TIME_LAYERS = flags.DEFINE_integer("time_layers", 2, "Depth of the timed model (0: skip timing).")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed optimizer steps (after one warm-up).")
_HLO_DIR = flags.DEFINE_string("hlo_dir", "", "If set, write each compiled HLO there.")

_COLLECTIVE = re.compile(
    r"\s(all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute)(-start|-done)?\("
)
# Matmuls in XLA:CPU's scheduled entry computation: plain dots and YNNPACK / oneDNN fusions.
_MATMUL = re.compile(r"\sdot\(|%ynn_fusion|onednn\$matmul")


def _setup(model_cfg, layout, relayout: str):
    import jax
    import optax
    from flax import nnx

    from composer_jax import config as config_lib
    from composer_jax import optim
    from composer_jax.model.layers import logical_axes_of
    from composer_jax.model.transformer import Transformer

    model = nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    axes = logical_axes_of(params)
    shardings = layout.tree_shardings(axes, params)
    cfg = config_lib.OptimizerConfig(name="muon")
    schedule = optax.constant_schedule(cfg.learning_rate)
    tx = optim.make_optimizer(cfg, schedule, axes, shardings, verbose=False)
    if relayout != "all_to_all":  # same optimizer, baseline relayout of the Newton-Schulz input
        ratio = cfg.muon_learning_rate / cfg.learning_rate
        tx = optax.chain(
            optax.clip_by_global_norm(cfg.clip_norm),
            optim.muon(
                lambda c: schedule(c) * ratio,
                axes,
                shardings=shardings,
                weight_decay=cfg.weight_decay,
                adam_b1=cfg.b1,
                adam_b2=cfg.b2,
                adam_weight_decay=cfg.weight_decay,
                relayout=relayout,
            ),
        )
    abstract = jax.tree.map(
        lambda sh, p: jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), p
        ),
        shardings,
        params,
        is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding),
    )
    return tx, abstract, axes, shardings


def _compile(tx, abstract):
    import jax

    state = jax.eval_shape(tx.init, abstract)
    t0 = time.perf_counter()
    compiled = jax.jit(tx.update).lower(abstract, state, abstract).compile()
    return compiled, time.perf_counter() - t0


def schedule_summary(hlo: str) -> str:
    """Order of collectives and matmuls in the scheduled entry computation, run-length coded."""
    marks = []
    for line in hlo.split("ENTRY", 1)[1].splitlines():
        coll = _COLLECTIVE.search(line)
        if coll:
            marks.append(coll.group(1) + (coll.group(2) or ""))
        elif _MATMUL.search(line):
            marks.append("matmul")
    runs: list[list] = []
    for mark in marks:
        if runs and runs[-1][0] == mark:
            runs[-1][1] += 1
        else:
            runs.append([mark, 1])
    starts = sum(m.endswith("-start") for m in marks)
    order = " | ".join(f"{m} x{n}" for m, n in runs)
    return f"{starts} async collective starts; order: {order}"


def main(_):
    import jax
    import numpy as np

    from composer_jax import config as config_lib
    from composer_jax import presets
    from composer_jax.parallel import make_layout
    from composer_jax.parallel.report import collective_bytes

    shape = tuple(int(v) for v in _LAYOUT.value)
    layout = make_layout(config_lib.MeshConfig(*shape))
    small = presets.small().model
    print(f"small preset, mesh (replica, fsdp, cp) = {shape}, {jax.device_count()} CPU devices")
    results = {}
    for relayout in ("all_gather", "all_to_all"):
        tx, abstract, _, _ = _setup(small, layout, relayout)
        compiled, compile_s = _compile(tx, abstract)
        hlo = compiled.as_text()
        if _HLO_DIR.value:
            os.makedirs(_HLO_DIR.value, exist_ok=True)
            with open(os.path.join(_HLO_DIR.value, f"muon_{relayout}.hlo.txt"), "w") as f:
                f.write(hlo)
        results[relayout] = {
            "bytes": collective_bytes(hlo),
            "compile_s": compile_s,
            "schedule": schedule_summary(hlo),
        }
        if _TIME_LAYERS.value:
            timed_cfg = dataclasses.replace(small, num_layers=_TIME_LAYERS.value)
            tx, abstract, _, shardings = _setup(timed_cfg, layout, relayout)
            compiled, _ = _compile(tx, abstract)
            rng = np.random.default_rng(0)
            make = lambda x: jax.device_put(  # noqa: E731
                rng.standard_normal(x.shape).astype(np.float32), x.sharding
            )
            params = jax.tree.map(make, abstract)
            grads = jax.tree.map(make, abstract)
            state = jax.jit(tx.init)(params)
            updates, state = compiled(grads, state, params)  # warm-up
            jax.block_until_ready(updates)
            t0 = time.perf_counter()
            for _ in range(_STEPS.value):
                updates, state = compiled(grads, state, params)
            jax.block_until_ready(updates)
            results[relayout]["step_s"] = (time.perf_counter() - t0) / _STEPS.value
    print()
    header = f"{'relayout':<11} {'collective MB/device (full small preset)':<58} {'total MB':>9}"
    header += f" {'compile s':>9} {'step s @' + str(_TIME_LAYERS.value) + ' layers':>16}"
    print(header)
    for relayout, r in results.items():
        by_op = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(r["bytes"].items()))
        total = sum(r["bytes"].values()) / 2**20
        step = f"{r['step_s']:.3f}" if "step_s" in r else "-"
        print(f"{relayout:<11} {by_op:<58} {total:>9.1f} {r['compile_s']:>9.1f} {step:>16}")
    gather = sum(results["all_gather"]["bytes"].values())
    a2a = sum(results["all_to_all"]["bytes"].values())
    print(f"\nall-to-all moves {gather / max(a2a, 1):.1f}x fewer bytes than all-gather")
    for relayout, r in results.items():
        print(f"\nschedule ({relayout}): {r['schedule']}")


if __name__ == "__main__":
    app.run(main)
