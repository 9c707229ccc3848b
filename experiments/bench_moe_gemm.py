r"""Expert grouped-GEMM throughput per backend at chosen MoE shapes, next to bf16 lax.ragged_dot.

The same cases as the GPU check (`experiments/gpu/gemm_cases.py`): each backend's result is
checked against a float32 reference before it is timed on the device clock (CUPTI), kernels
alone on pre-quantized operands, quantization and the op end to end as their own rows; % peak is
of the MMA format the backend runs. In-process (no per-case timeout: use gpu_check.py for that).
Without a GPU it runs the tiny dry-run shapes in interpret / lowering mode (not a speed).

  python experiments/bench_moe_gemm.py [--k=7168] [--n=2048] [--experts=8]
      [--per_expert=128,1024,4096] [--routing=balanced,skewed] [--backends=ragged_dot_bf16,...]
"""

from absl import app, flags

_K = flags.DEFINE_integer("k", 7168, "Contracted width (hidden size for the up projection).")
_N = flags.DEFINE_integer("n", 2048, "Output width (expert intermediate size).")
_EXPERTS = flags.DEFINE_integer("experts", 8, "Experts on the device.")
_PER_EXPERT = flags.DEFINE_list("per_expert", ["128", "1024", "4096"], "Mean rows per expert.")
_ROUTING = flags.DEFINE_list("routing", ["balanced", "skewed"], "balanced | skewed.")
_BACKENDS = flags.DEFINE_list("backends", [], "Backends to run (default: all).")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed calls per case.")


def main(argv):
    del argv
    import jax

    from experiments.gpu import gemm_cases

    dry_run = jax.default_backend() != "gpu"
    ctx = {"dry_run": dry_run, "device_kind": jax.devices()[0].device_kind}
    if dry_run:
        print(f"No GPU ({jax.default_backend()}): tiny shapes in interpret / lowering mode.")
        shapes = gemm_cases.DRY_SHAPES
    else:
        shapes = [
            dict(name=f"k{_K.value}_n{_N.value}_e{_EXPERTS.value}_t{t}_{r}", k=_K.value,
                 n=_N.value, experts=_EXPERTS.value, per_expert=int(t), routing=r)
            for t in _PER_EXPERT.value
            for r in _ROUTING.value
        ]  # fmt: skip
    backends = _BACKENDS.value or gemm_cases.BACKENDS
    print(f"{ctx['device_kind']}")
    header = f"{'shape':<34} {'backend':<30} {'ms':>9} {'TFLOP/s':>8} {'fmt':>5} {'% peak':>7}"
    print(header + f" {'vs ragged_dot':>13} {'rel err':>8}")
    for shape in shapes:
        base = {}
        for backend in backends:
            params = {"shape": shape, "backend": backend, "iterations": _ITERS.value}
            try:
                r = gemm_cases.run(params, ctx)
            except Exception as err:  # noqa: BLE001 -- one failing backend must not hide others
                r = {"status": "fail", "error": f"{type(err).__name__}: {err}"}
            label = f"{shape['name']:<34} {backend:<30}"
            if r["status"] != "ok" or "ms" not in r:
                why = r.get("reason") or r.get("error") or r.get("mode") or r.get("check")
                print(f"{label} {r['status']}: {why}"[:220])
                continue
            base[backend] = r["ms"]
            ref = base.get("xla_wgrad_bf16" if "wgrad" in backend else "ragged_dot_bf16")
            ratio = f"{ref / r['ms']:.2f}x" if ref and "quantize" not in backend else ""
            share = f"{100 * r['peak_fraction']:.1f}" if r.get("peak_fraction") else ""
            rate = f"{r['tflops']:.1f}" if "tflops" in r else f"{r.get('gb_per_s', 0):.0f}GB/s"
            err = r.get("check", {}).get("max_rel_err", float("nan"))
            print(
                f"{label} {r['ms']:>9.3f} {rate:>8} {r.get('format', ''):>5} {share:>7}"
                f" {ratio:>13} {err:>8.1e}"
            )


if __name__ == "__main__":
    app.run(main)
