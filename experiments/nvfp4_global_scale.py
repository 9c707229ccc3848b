r"""NVFP4 with a per-token global scale vs a per-tensor one: does a sample's output depend on its
batch-mates?

  python experiments/nvfp4_global_scale.py [--workdir=RUN] [--compositions=12] [--out=PNG]

The tiny model runs its routed experts in NVFP4 (`model.expert_precision=nvfp4_fwd_mxfp8_bwd`,
reference backend). One fixed sample (a sequence of standard-library code) is put in batches
with different batch-mates drawn from a pool of other sequences, and its logits are compared
across those batches, once with the package's per-token FP32 scale (DESIGN.md section 5) and once
with a per-tensor scale: the same `formats.quantize_nvfp4` applied to the whole activation matrix
of the grouped GEMM as one vector (one amax over every routed token of the batch; the weights keep
their own scales). Also: each mode's distance to the bf16 model on the same sample. Prints a
markdown table for experiments/RESULTS.md. The per-tensor variant exists only in this script.
"""

import contextlib
import dataclasses
import os

from absl import app, flags

FLAGS = flags.FLAGS


MODES = ("per_token", "per_tensor")


@contextlib.contextmanager
def per_tensor_activations():
    """Within the block, NVFP4 activation matrices [M, K] share one global scale: quantized as a
    single vector of M*K values (blocks of 16 stay inside a row since K is a multiple of 16)."""
    import jax
    import jax.numpy as jnp

    from composer_jax.quant import formats

    original = formats.quantize_nvfp4

    def quantize(x, *, axis=-1, **kwargs):
        if x.ndim != 2 or axis % 2 != 1:
            return original(x, axis=axis, **kwargs)
        rows, cols = x.shape
        q = original(x.reshape(1, rows * cols), axis=1, **kwargs)
        return formats.NVFP4Tensor(
            values=q.values.reshape(rows, cols),
            scales=q.scales.reshape(rows, cols // formats.NVFP4_BLOCK),
            row_scales=jnp.broadcast_to(q.row_scales, (rows, 1)),
            axis=1,
            block=q.block,
        )

    formats.quantize_nvfp4 = quantize
    jax.clear_caches()  # nothing traced with the other quantizer may be reused
    try:
        yield
    finally:
        formats.quantize_nvfp4 = original
        jax.clear_caches()


def load_model(workdir: str, seed: int):
    """(bf16 model, NVFP4 model) with the same weights."""
    from flax import nnx

    from composer_jax import model, presets

    if workdir:
        from composer_jax.train import load_run

        base = load_run(workdir).model
        cfg = base.cfg
    else:
        cfg = presets.tiny().model
        base = model.init_model(cfg, seed)
    quantized = model.init_model(
        dataclasses.replace(cfg, expert_precision="nvfp4_fwd_mxfp8_bwd"), seed
    )
    nnx.update(quantized, nnx.state(base))
    return base, quantized


def sequences(count: int, length: int) -> "np.ndarray":  # noqa: F821
    """`count` byte-token sequences of standard-library code (the corpus' first files)."""
    import numpy as np

    from composer_jax.data import CodeCorpus, load_tokenizer

    tokenizer = load_tokenizer("byte")
    corpus = CodeCorpus(split="train")
    rows, index = [], 0
    while len(rows) < count:
        ids = tokenizer.encode(corpus[index], add_bos=True)
        index += 1
        rows += [ids[i : i + length] for i in range(0, len(ids) - length, length)][:2]
    return np.asarray(rows[:count], np.int32)


def sample_logits(m, batches) -> "np.ndarray":  # noqa: F821
    """Logits of the sample (row 0) in each batch."""
    import numpy as np

    from composer_jax.model import compute_logits

    return np.stack([np.asarray(compute_logits(m, b)[0], np.float64) for b in batches])


def kl_rows(p_logits, q_logits) -> "np.ndarray":  # noqa: F821
    """KL(softmax p || softmax q) per position."""
    import numpy as np
    from scipy.special import log_softmax

    logp, logq = log_softmax(p_logits, axis=-1), log_softmax(q_logits, axis=-1)
    return np.sum(np.exp(logp) * (logp - logq), axis=-1)


def measure(workdir, compositions, batch, seq_len, pool, seed) -> tuple[list[dict], dict]:
    import numpy as np

    base, quantized = load_model(workdir, seed)
    data = sequences(pool + 1, seq_len)
    sample, mates = data[0], data[1:]
    rng = np.random.default_rng(seed)
    batches = [
        np.concatenate([sample[None], mates[rng.choice(len(mates), batch - 1, replace=False)]])
        for _ in range(compositions)
    ]
    reference = sample_logits(base, batches[:1])[0]
    rows, curves = [], {}
    for mode in MODES:
        scope = per_tensor_activations() if mode == "per_tensor" else contextlib.nullcontext()
        with scope:
            logits = sample_logits(quantized, batches)
        deviation = np.abs(logits - logits[0])  # against the first batch
        top1 = logits.argmax(-1)
        kl_to_bf16 = np.stack([kl_rows(reference, lg).mean() for lg in logits])
        spread = logits.std(axis=0).mean()  # per logit across batches, averaged
        rows.append(
            {
                "mode": mode,
                "max_abs": float(deviation.max()),
                "mean_std": float(spread),
                "top1_changed": float((top1 != top1[0]).mean()),
                "kl_between": float(np.mean([kl_rows(logits[0], lg).mean() for lg in logits[1:]])),
                "kl_bf16_mean": float(kl_to_bf16.mean()),
                "kl_bf16_min": float(kl_to_bf16.min()),
                "kl_bf16_max": float(kl_to_bf16.max()),
                "identical": bool((deviation == 0).all()),
            }
        )
        curves[mode] = kl_to_bf16
    return rows, curves


def markdown(rows: list[dict]) -> str:
    lines = [
        "| global scale | sample's logits identical in every batch | max abs logit change | "
        "mean std of a logit across batches | top-1 changed (positions x batches) | "
        "KL between batches | KL to bf16: mean (min..max over batches) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode'].replace('_', '-')} | {'yes' if r['identical'] else 'no'} | "
            f"{r['max_abs']:.3g} | {r['mean_std']:.3g} | {100 * r['top1_changed']:.2f}% | "
            f"{r['kl_between']:.3g} | {r['kl_bf16_mean']:.4g} ({r['kl_bf16_min']:.4g}.."
            f"{r['kl_bf16_max']:.4g}) |"
        )
    return "\n".join(lines)


def plot(curves: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for mode, values in curves.items():
        ax.plot(range(len(values)), values, "o-", label=mode.replace("_", "-") + " global scale")
    ax.set(
        xlabel="batch (same sample, other batch-mates)",
        ylabel="sample's mean KL to bf16 logits",
        title="NVFP4 experts: one sample in different batches",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv):
    del argv
    rows, curves = measure(
        FLAGS.workdir,
        FLAGS.compositions,
        FLAGS.batch,
        FLAGS.seq_len,
        FLAGS.pool,
        FLAGS.seed,
    )
    print(markdown(rows))
    plot(curves, FLAGS.out)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":  # flags only when run, so tests can import the functions
    flags.DEFINE_string("workdir", "", "A run whose weights to use (default: fresh init).")
    flags.DEFINE_integer("compositions", 12, "Batches the sample is put in.")
    flags.DEFINE_integer("batch", 8, "Sequences per batch (the sample and its batch-mates).")
    flags.DEFINE_integer("seq_len", 128, "Tokens per sequence.")
    flags.DEFINE_integer("pool", 48, "Sequences the batch-mates are drawn from.")
    flags.DEFINE_integer("seed", 0, "Draws of batch-mates (and the fresh init).")
    flags.DEFINE_string("out", "experiments/figures/nvfp4_global_scale.png", "Figure.")
    app.run(main)
