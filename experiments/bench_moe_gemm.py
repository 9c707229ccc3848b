r"""Expert grouped-GEMM throughput per backend at MoE shapes, next to bf16 `lax.ragged_dot`.

Rows = tokens x top-k routed slots, spread evenly over the experts; each case times the forward
GEMM [rows, hidden] x [experts, hidden, ffn], quantization of both operands included for the
low-precision backends. Prints TFLOP/s and % of the chip's dense bf16 peak.
Without a GPU it says so and runs a tiny smoke test of the reference backend instead.

  python experiments/bench_moe_gemm.py [--tokens=16384] [--hidden=2048,7168] [--experts=8,64]
      [--topk=8] [--ffn=2048] [--iters=20]
"""

import functools
import statistics
import time

from absl import app, flags

_TOKENS = flags.DEFINE_integer("tokens", 16384, "Tokens per step.")
_HIDDEN = flags.DEFINE_list("hidden", ["2048", "7168"], "Model widths (the contracted K).")
_EXPERTS = flags.DEFINE_list("experts", ["8", "64"], "Experts on the device.")
_TOPK = flags.DEFINE_integer("topk", 8, "Experts per token.")
_FFN = flags.DEFINE_integer("ffn", 2048, "Expert intermediate size (the output N).")
_ITERS = flags.DEFINE_integer("iters", 20, "Timed calls per case, after a warm-up call.")

# Dense bf16 tensor-core peak, FLOP/s.
_BF16_PEAK = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "GB200": 2500e12}


def _peak(device_kind: str) -> float | None:
    return next((v for k, v in _BF16_PEAK.items() if k in device_kind.upper()), None)


def _seconds(fn, *args, iters: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _backends(device_kind: str) -> dict:
    """name -> f(lhs, rhs, group_sizes) for every backend that runs on this device."""
    import jax
    import jax.numpy as jnp

    from composer_jax.quant.moe_gemm import quantized_expert_gemm
    from kernels_pallas import hopper_grouped_gemm

    def ragged(lhs, rhs, sizes):
        return jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)

    cases = {"bf16 lax.ragged_dot": ragged}
    for precision in ("mxfp8", "nvfp4_fwd_mxfp8_bwd"):
        cases[f"{precision} reference"] = functools.partial(
            quantized_expert_gemm, precision=precision, backend="reference"
        )
    if jax.default_backend() == "gpu":
        cases["bf16 pallas_hopper kernel"] = hopper_grouped_gemm.grouped_gemm
        kernel_backends = ["pallas_hopper"]
        if "B200" in device_kind.upper():
            kernel_backends.append("pallas_blackwell")
        for backend in kernel_backends:
            for precision in ("mxfp8", "nvfp4_fwd_mxfp8_bwd"):
                cases[f"{precision} {backend} (quantize + kernel)"] = functools.partial(
                    quantized_expert_gemm, precision=precision, backend=backend
                )
    return {name: jax.jit(fn) for name, fn in cases.items()}


def _case(tokens: int, hidden: int, experts: int, topk: int, ffn: int):
    import jax
    import jax.numpy as jnp

    rows = tokens * topk
    k_lhs, k_rhs = jax.random.split(jax.random.key(0))
    lhs = jax.random.normal(k_lhs, (rows, hidden), jnp.bfloat16)
    rhs = (jax.random.normal(k_rhs, (experts, hidden, ffn)) / hidden**0.5).astype(jnp.bfloat16)
    sizes = jnp.full((experts,), rows // experts, jnp.int32).at[0].add(rows % experts)
    return lhs, rhs, sizes, 2.0 * rows * hidden * ffn


def main(argv):
    del argv
    import jax

    device = jax.devices()[0]
    if jax.default_backend() != "gpu":
        print(f"No GPU (platform {jax.default_backend()!r}): smoke test of the reference backend.")
        lhs, rhs, sizes, flops = _case(64, 64, 4, 2, 32)
        for name, fn in _backends(device.device_kind).items():
            seconds = _seconds(fn, lhs, rhs, sizes, iters=2)
            print(f"  {name:<45} {flops / seconds / 1e9:8.2f} GFLOP/s (CPU, meaningless)")
        return
    peak = _peak(device.device_kind)
    print(f"{device.device_kind}; dense bf16 peak {peak / 1e12 if peak else float('nan'):.0f} TF/s")
    print(f"{'case':<32} {'backend':<45} {'ms':>8} {'TFLOP/s':>8} {'% peak':>7}")
    backends = _backends(device.device_kind)
    for hidden in map(int, _HIDDEN.value):
        for experts in map(int, _EXPERTS.value):
            lhs, rhs, sizes, flops = _case(_TOKENS.value, hidden, experts, _TOPK.value, _FFN.value)
            label = f"T={_TOKENS.value} D={hidden} E={experts} F={_FFN.value}"
            for name, fn in backends.items():
                try:
                    seconds = _seconds(fn, lhs, rhs, sizes, iters=_ITERS.value)
                except Exception as err:  # one failing backend must not hide the others
                    print(f"{label:<32} {name:<45} failed: {type(err).__name__}: {err}"[:200])
                    continue
                tflops = flops / seconds / 1e12
                share = f"{100 * tflops * 1e12 / peak:6.1f}%" if peak else "    n/a"
                print(f"{label:<32} {name:<45} {seconds * 1e3:8.3f} {tflops:8.1f} {share}")


if __name__ == "__main__":
    app.run(main)
