r"""Expert grouped GEMM on CPU: `lax.ragged_dot` vs the tiled product vs the ideal dense work.

For each shape, dtype and routing, forward and forward+backward (d lhs and d rhs) time of
- `ragged_dot`: `lax.ragged_dot` (XLA:CPU expands it densely: rows x experts x K x N),
- `tiled`: `composer_jax.model.grouped_gemm.grouped_matmul` (expert-aligned row tiles),
- `ideal`: one batched einsum over equal segments (rows / experts each): the same FLOPs with no
  routing at all, the floor the tiled product is measured against (target: within 2x).
Shapes: the one in issue 18 and the expert GEMMs of the tiny / rl_tiny models at their training
batches. Then whole pretraining steps with each expert GEMM: rl_tiny (its SFT phase's batch) and
a model shaped like issue 18's side-by-side comparison.

  python experiments/bench_expert_gemm.py [--shapes=issue,rl_tiny_up,rl_tiny_down,tiny_up]
      [--dtypes=float32,bfloat16] [--routing=balanced,skewed] [--train_steps=5]
      [--train_models=rl_tiny,issue_model]
"""

import dataclasses
import functools
import os
import time

from absl import app, flags

_SHAPES = flags.DEFINE_list(
    "shapes", ["issue", "rl_tiny_up", "rl_tiny_down", "tiny_up"], "GEMM shapes to measure."
)
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Compute dtypes.")
_ROUTING = flags.DEFINE_list(
    "routing", ["balanced", "skewed"], "Group sizes: equal, or a fixed Dirichlet draw."
)
_MIN_TIME = flags.DEFINE_float("min_time", 0.3, "Seconds of timed calls per measurement.")
_TRAIN_STEPS = flags.DEFINE_integer("train_steps", 5, "Timed train steps per model (0 skips).")
_TRAIN_MODELS = flags.DEFINE_list(
    "train_models", ["rl_tiny", "issue_model"], "Pretraining steps to measure (train_configs)."
)


def gemm_shapes() -> dict[str, tuple[int, int, int, int]]:
    """name -> (rows, K, N, experts); the model shapes come from the presets."""
    from composer_jax import presets

    tiny, rl_tiny = presets.tiny(), presets.rl_tiny()
    m = tiny.model
    d, f, e, k = m.hidden_size, m.moe_intermediate_size, m.num_experts, m.num_experts_per_tok
    rl_phase, tiny_phase = rl_tiny.train.phases[0], tiny.train.phases[0]
    rl_rows = rl_phase.batch_size * rl_phase.seq_len * k
    return {
        "issue": (4096, 256, 128, 16),
        "rl_tiny_up": (rl_rows, d, f, e),
        "rl_tiny_down": (rl_rows, f, d, e),
        "tiny_up": (tiny_phase.batch_size * tiny_phase.seq_len * k, d, f, e),
    }


def group_sizes(rows: int, experts: int, routing: str):
    import numpy as np

    if routing == "balanced":
        return np.full(experts, rows // experts, np.int32)
    rng = np.random.default_rng(0)
    return rng.multinomial(rows, rng.dirichlet(np.full(experts, 2.0))).astype(np.int32)


def interleaved_ms(calls: dict, rounds: int = 3) -> dict:
    """name -> wall ms of one call: each call timed for `--min_time` / rounds seconds per round,
    rounds interleaved across the calls; the best round's median counts (other jobs share the
    cores, and a burst of their load should not decide a ratio)."""
    import jax
    import numpy as np

    for call in calls.values():
        jax.block_until_ready(call())  # compile and warm up
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times, start = [], time.perf_counter()
            while len(times) < 3 or (
                time.perf_counter() - start < _MIN_TIME.value / rounds and len(times) < 30
            ):
                t0 = time.perf_counter()
                jax.block_until_ready(call())
                times.append(time.perf_counter() - t0)
            best[name] = min(best[name], 1e3 * float(np.median(times)))
    return best


def measure_gemm(rows, k, n, experts, dtype, routing) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from composer_jax.model import grouped_gemm, moe

    def ideal(lhs, rhs, sizes):
        del sizes  # equal segments: the FLOPs of the grouped product with no routing
        out = jnp.einsum(
            "gmk,gkn->gmn",
            lhs.reshape(experts, rows // experts, k),
            rhs,
            preferred_element_type=jnp.float32,
        )
        return out.astype(lhs.dtype).reshape(rows, n)

    impls = {
        "ragged_dot": functools.partial(moe.expert_gemm, impl="ragged_dot"),
        "tiled": grouped_gemm.grouped_matmul,
        "ideal": ideal,
    }
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.normal(size=(rows, k)), dtype)
    rhs = jnp.asarray(rng.normal(size=(experts, k, n)) / np.sqrt(k), dtype)
    grad_out = jnp.asarray(rng.normal(size=(rows, n)), dtype)
    sizes = jnp.asarray(group_sizes(rows, experts, routing))
    calls = {}
    for name, fn in impls.items():

        def with_grads(lhs, rhs, sizes, fn=fn):
            out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
            return out, *vjp(grad_out)

        calls[name, "fwd"] = functools.partial(jax.jit(fn), lhs, rhs, sizes)
        calls[name, "fwd+bwd"] = functools.partial(jax.jit(with_grads), lhs, rhs, sizes)
    times = interleaved_ms(calls)
    result = {name: (times[name, "fwd"], times[name, "fwd+bwd"]) for name in impls}
    return {"sizes": np.asarray(sizes), **result}


def train_configs() -> dict:
    """name -> (experiment config, (batch, seq_len)) of the pretraining steps measured."""
    from composer_jax import presets

    rl_tiny = presets.rl_tiny()
    phase = rl_tiny.train.phases[0]
    # Issue 18's side-by-side model; the issue gives no expert width or attention shape, so the
    # expert width is K=256 -> N=128 of its GEMM and attention keeps tiny's defaults.
    issue_model = dataclasses.replace(
        rl_tiny.model,
        vocab_size=2048,
        hidden_size=256,
        num_layers=4,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
        dtype="float32",
    )
    return {
        "rl_tiny": (rl_tiny, (phase.batch_size, phase.seq_len)),
        "issue_model": (dataclasses.replace(rl_tiny, model=issue_model), (4, 256)),
    }


def compile_train_step(name: str, impl: str):
    """(one-step closure, compile seconds): the pretraining step (`train.loop`'s jitted step on a
    batch of random tokens) of config `name` with the expert GEMM forced to `impl`."""
    import jax
    import numpy as np

    from composer_jax.train import loop

    cfg, (batch_size, seq_len) = train_configs()[name]
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, expert_gemm_impl=impl))
    setup = loop.make_train_setup(cfg)
    rng = np.random.default_rng(0)
    shape = (batch_size, seq_len)
    batch = {
        "tokens": rng.integers(0, cfg.model.vocab_size, shape).astype(np.int32),
        "segment_ids": np.ones(shape, np.int32),
        "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), shape).copy(),
    }
    batch = jax.device_put(batch, setup.layout.batch_sharding())
    state = {"train": setup.init_state()}
    t0 = time.perf_counter()
    compiled = setup.jit_train_step().trace(state["train"], batch).lower().compile()
    compile_s = time.perf_counter() - t0

    def one_step():
        state["train"], metrics = compiled(state["train"], batch)
        jax.block_until_ready(metrics)

    one_step()  # warm-up
    return one_step, compile_s


def measure_train_steps(name: str, impls: tuple[str, ...], steps: int, rounds: int = 3) -> dict:
    """impl -> (compile s, step s): `steps` steps of each impl per round, rounds interleaved;
    the best round's median counts, as in `interleaved_ms`."""
    import numpy as np

    compiled = {impl: compile_train_step(name, impl) for impl in impls}
    best = {impl: float("inf") for impl in impls}
    for _ in range(rounds):
        for impl, (one_step, _) in compiled.items():
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                one_step()
                times.append(time.perf_counter() - t0)
            best[impl] = min(best[impl], float(np.median(times)))
    return {impl: (compiled[impl][1], best[impl]) for impl in impls}


def main(argv):
    del argv
    import jax

    shapes = gemm_shapes()
    print(
        f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}, "
        f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print("ms per call (best of 3 interleaved rounds' medians); ratios of those times")
    print(
        "| shape (rows x K -> N, experts) | dtype | routing (max/min group) | ragged_dot fwd | "
        "tiled fwd | ideal fwd | ragged_dot f+b | tiled f+b | ideal f+b | tiled/ideal fwd | "
        "tiled/ideal f+b | ragged_dot/tiled f+b |"
    )
    print("| --- | --- | --- |" + " ---: |" * 9)
    for shape in _SHAPES.value:
        rows, k, n, experts = shapes[shape]
        for dtype in _DTYPES.value:
            for routing in _ROUTING.value:
                r = measure_gemm(rows, k, n, experts, dtype, routing)
                (rf, rb), (tf, tb), (i_f, ib) = r["ragged_dot"], r["tiled"], r["ideal"]
                print(
                    f"| {shape} ({rows} x {k} -> {n}, {experts}) | {dtype} | {routing} "
                    f"({r['sizes'].max()}/{r['sizes'].min()}) | {rf:.2f} | {tf:.2f} | "
                    f"{i_f:.2f} | {rb:.2f} | {tb:.2f} | {ib:.2f} | {tf / i_f:.2f} | "
                    f"{tb / ib:.2f} | {rb / tb:.1f} |",
                    flush=True,
                )
    for name in _TRAIN_MODELS.value if _TRAIN_STEPS.value else ():
        cfg, (batch_size, seq_len) = train_configs()[name]
        m = cfg.model
        print(
            f"\n{name} pretraining step: hidden {m.hidden_size}, {m.num_layers} layers, "
            f"{m.num_experts} experts top-{m.num_experts_per_tok} (width "
            f"{m.moe_intermediate_size}), vocab {m.vocab_size}, {m.dtype}, batch {batch_size} x "
            f"{seq_len}; best median of 3 interleaved rounds x {_TRAIN_STEPS.value} steps"
        )
        print("| expert GEMM | compile s | step ms | tokens/s | vs ragged_dot |")
        print("| --- | ---: | ---: | ---: | ---: |")
        results = measure_train_steps(name, ("ragged_dot", "tiled"), _TRAIN_STEPS.value)
        base_s = results["ragged_dot"][1]
        for impl, (compile_s, step_s) in results.items():
            print(
                f"| {impl} | {compile_s:.1f} | {1e3 * step_s:.0f} | "
                f"{batch_size * seq_len / step_s:.0f} | {base_s / step_s:.2f} |",
                flush=True,
            )
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    app.run(main)
