r"""Loading a DeepSeek-V3-layout checkpoint: speed and host memory of the streaming load against
the eager reference.

Writes a random model of the chosen shape as a sharded HF checkpoint (bf16, or DeepSeek-V3's fp8
blocks with --fp8), then loads it in a fresh process per mode (`interop.load_hf_checkpoint`, the
streaming one; `eager`: every tensor read whole and mapped in float32, the reference) and reports
seconds, GB/s of checkpoint read, and the memory the load held besides the loaded model (the
process's high-water mark VmHWM minus its size before the load and the model's bytes: on CPU the
loaded model itself lives in host memory). The limit is the one the tests hold the streaming load
to: 1.5x the largest tensor (in bf16) plus a fixed allowance.

  PYTHONPATH=. python experiments/bench_load.py [--hidden=1024] [--experts=32] [--fp8]
"""

import dataclasses
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

from absl import app, flags

ALLOWANCE_BYTES = 40 << 20  # compiling the piece writes, Python objects (23 MiB measured)

_HIDDEN = flags.DEFINE_integer("hidden", 1024, "Model width.")
_EXPERTS = flags.DEFINE_integer("experts", 32, "Routed experts per MoE layer.")
_MOE_WIDTH = flags.DEFINE_integer("moe_intermediate", 512, "Each expert's hidden width.")
_LAYERS = flags.DEFINE_integer("layers", 4, "Decoder layers (the first one dense).")
_VOCAB = flags.DEFINE_integer("vocab", 8192, "Vocabulary size.")
_FP8 = flags.DEFINE_bool("fp8", False, "Write the linears in DeepSeek-V3's fp8 blocks.")
_DIR = flags.DEFINE_string("dir", None, "Checkpoint folder (default: a temporary one).")
_MEASURE = flags.DEFINE_enum(
    "measure", None, ["streaming", "eager"], "Internal: measure one load of --dir, print JSON."
)


def _vm_hwm() -> int:
    status = open("/proc/self/status").read()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) * 1024


def _rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()


def measure_in_this_process(folder: str, mode: str) -> dict:
    """Loads `folder` in bf16 ("streaming" or "eager") and returns bytes and seconds. Meant for
    a fresh process: its high-water mark must be the load's own."""
    import jax
    from flax import nnx

    from composer_jax.interop import hf, safetensors_io, streaming

    hf._write_piece_in_place(jax.numpy.zeros((2, 2)), jax.numpy.ones((1, 2)), (0, 0))  # warm
    before, start = _rss(), time.perf_counter()
    if mode == "eager":
        config, tensors = safetensors_io.read_hf_checkpoint(folder)
        cfg = hf.config_from_hf(config, param_dtype="bfloat16")
        state = jax.tree.map(
            lambda x: jax.numpy.asarray(x, "bfloat16"), hf.params_from_hf(tensors, cfg)
        )
        del tensors
    else:
        with streaming.CheckpointReader(folder) as reader:
            state = nnx.state(hf.load_from_reader(reader, param_dtype="bfloat16"))
    leaves = jax.tree.leaves(state)
    jax.block_until_ready(leaves)
    return {
        "seconds": time.perf_counter() - start,
        "before": before,
        "peak": _vm_hwm(),
        "result": sum(x.nbytes for x in leaves),
    }


def measure(folder, mode: str) -> dict:
    """`measure_in_this_process` in a fresh Python, plus `held`: bytes held besides the model."""
    done = subprocess.run(
        [sys.executable, "-m", "experiments.bench_load", f"--measure={mode}", f"--dir={folder}"],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    if done.returncode:
        raise RuntimeError(f"{mode} load failed: {done.stderr[-2000:]}")
    m = json.loads(done.stdout.strip().splitlines()[-1])
    return m | {"held": m["peak"] - m["before"] - m["result"]}


def memory_limit(folder) -> tuple[int, int]:
    """(largest tensor in bf16, the limit 1.5x that plus the allowance) in bytes."""
    from composer_jax.interop import streaming

    with streaming.CheckpointReader(folder) as reader:
        largest = max(e.nbytes // e.dtype.itemsize * 2 for e in reader.entries.values())
    return largest, int(1.5 * largest) + ALLOWANCE_BYTES


def _write(folder: str) -> None:
    from composer_jax.interop import export_hf_checkpoint
    from composer_jax.model import init_model
    from composer_jax.presets import tiny

    cfg = dataclasses.replace(
        tiny().model,
        vocab_size=_VOCAB.value,
        hidden_size=_HIDDEN.value,
        num_layers=_LAYERS.value,
        first_k_dense=1,
        intermediate_size=2 * _HIDDEN.value,
        moe_intermediate_size=_MOE_WIDTH.value,
        num_experts=_EXPERTS.value,
        num_mtp_layers=0,
        dtype="float32",
        param_dtype="bfloat16",
    )
    dtype = "fp8" if _FP8.value else "bfloat16"
    export_hf_checkpoint(init_model(cfg, 0), folder, dtype=dtype, shard_bytes=256 << 20)


def main(argv):
    del argv
    if _MEASURE.value:
        print(json.dumps(measure_in_this_process(_DIR.value, _MEASURE.value)))
        return
    with tempfile.TemporaryDirectory(prefix="bench_load_") as scratch:
        folder = _DIR.value or os.path.join(scratch, "ckpt")
        if not os.path.exists(os.path.join(folder, "config.json")):
            _write(folder)
        size = sum(
            os.path.getsize(os.path.join(folder, f))
            for f in os.listdir(folder)
            if f.endswith(".safetensors")
        )
        largest, limit = memory_limit(folder)
        mib = 1 << 20
        print(
            f"checkpoint {size / mib:.0f} MiB ({'fp8 blocks' if _FP8.value else 'bf16'}); "
            f"largest tensor {largest / mib:.1f} MiB (bf16); limit {limit / mib:.1f} MiB"
        )
        print("| load | seconds | GB/s | held besides the model (MiB) | within the limit |")
        print("| --- | ---: | ---: | ---: | --- |")
        for mode in ("streaming", "eager"):
            m = measure(folder, mode)
            print(
                f"| {mode} | {m['seconds']:.1f} | {size / m['seconds'] / 1e9:.2f} | "
                f"{m['held'] / mib:.0f} | {'yes' if m['held'] < limit else 'no'} |"
            )


if __name__ == "__main__":
    app.run(main)
