r"""Figures for the RL objective: k1 vs k3 spread in two settings, length penalty curves.

  python experiments/rl_objective_figures.py [--out=experiments/figures] [--vocab=32]

k1 = log(p/q) and k3 = (r - 1) - log r (r = q/p) are both unbiased estimates of KL(p || q) from
one sample y ~ p. Their spread (std of a one-sample estimate) is computed exactly and checked by
Monte Carlo, against the true KL, in two settings:
  categorical: a 32-way softmax policy p and a reference q whose logits drift along a random
    direction (the setting of a token-level LM policy: bounded log-ratios);
  gaussian: p = N(0, 1), q = N(mu, 1), KL = mu^2 / 2 (the report's setting). Exactly,
    std(k1) = mu and std(k3) = sqrt(exp(mu^2) - 1 - mu^2): k3's spread grows like exp(KL).
Prints both tables as markdown (for experiments/RESULTS.md) and writes kl_k1_vs_k3_spread.png
(both settings) and length_penalty_curves.png.
"""

import math
import os

from absl import app, flags

FLAGS = flags.FLAGS


LENGTH_PARAMS = ((1e-3, 0.0), (1e-3, 0.5), (1e-3, 1.0), (1e-3, 1.5), (1e-3, 2.0), (1e-4, 1.5))
GAUSSIAN_MEANS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0)


def _monte_carlo(row: dict, logp, ref_logp) -> None:
    """Adds the sample mean and std of k1 and k3 (through the package's estimator) to `row`."""
    import numpy as np

    from composer_jax.rl import kl_estimate

    for name in ("k1", "k3"):
        mc = np.asarray(kl_estimate(logp, ref_logp, name), np.float64)
        row[f"{name}_mc_mean"] = float(mc.mean())
        row[f"{name}_mc_std"] = float(mc.std())


def estimator_spread(vocab: int, samples: int) -> list[dict]:
    """Categorical setting: exact KL, exact and Monte-Carlo std of k1 and k3, as the reference
    moves away."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    theta = rng.normal(size=vocab)
    direction = rng.normal(size=vocab)
    pi = np.exp(theta - np.log(np.exp(theta).sum()))
    rows = []
    for distance in np.geomspace(0.02, 4.0, 16):
        ref_logits = theta + distance * direction
        ref = np.exp(ref_logits - np.log(np.exp(ref_logits).sum()))
        log_ratio = np.log(pi) - np.log(ref)
        kl = float(pi @ log_ratio)
        exact = {"k1": log_ratio, "k3": np.expm1(-log_ratio) + log_ratio}
        key = jax.random.key(int(distance * 1000))
        ys = jax.random.categorical(key, jnp.asarray(np.log(pi)), shape=(samples,))
        logp = jnp.asarray(np.log(pi), jnp.float32)[ys]
        ref_logp = jnp.asarray(np.log(ref), jnp.float32)[ys]
        row = {"distance": float(distance), "kl": kl}
        for name, values in exact.items():
            row[f"{name}_std"] = float(np.sqrt(pi @ (values - kl) ** 2))
        _monte_carlo(row, logp, ref_logp)
        rows.append(row)
    return rows


def gaussian_spread(samples: int, means=GAUSSIAN_MEANS) -> list[dict]:
    """Gaussian setting: p = N(0, 1), q = N(mu, 1), samples of p; exact and Monte-Carlo std."""
    import jax
    import jax.numpy as jnp

    rows = []
    for i, mu in enumerate(means):
        x = jax.random.normal(jax.random.key(100 + i), (samples,), jnp.float32)
        logp, ref_logp = -0.5 * x**2, -0.5 * (x - mu) ** 2  # the shared constant cancels
        row = {
            "mu": mu,
            "kl": mu**2 / 2,
            "k1_std": abs(mu),
            "k3_std": math.sqrt(math.expm1(mu**2) - mu**2),
        }
        _monte_carlo(row, logp, ref_logp)
        rows.append(row)
    return rows


def markdown_table(rows: list[dict], first: str) -> str:
    lines = [
        f"| {first} | KL | std k1 | std k3 | std k3 / std k1 | MC mean k1 | MC mean k3 | MC std k3 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    key = "mu" if first == "mu" else "distance"
    for r in rows:
        lines.append(
            f"| {r[key]:.3g} | {r['kl']:.4g} | {r['k1_std']:.4g} | {r['k3_std']:.4g} | "
            f"{r['k3_std'] / r['k1_std']:.3g} | {r['k1_mc_mean']:.4g} | {r['k3_mc_mean']:.4g} | "
            f"{r['k3_mc_std']:.4g} |"
        )
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_spread(categorical: list[dict], gaussian: list[dict], path: str) -> None:
    """Std of a one-sample estimate against the true KL, both settings side by side."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    settings = (
        (axes[0], categorical, "categorical (32 ids), reference logits drifting"),
        (axes[1], gaussian, "p = N(0,1), q = N(mu,1): the report's setting"),
    )
    for ax, rows, title in settings:
        kl = [r["kl"] for r in rows]
        for name, style in (("k1", "o-"), ("k3", "s-")):
            ax.loglog(kl, [r[f"{name}_std"] for r in rows], style, label=f"{name} (exact)")
            ax.loglog(kl, [r[f"{name}_mc_std"] for r in rows], "k.", ms=4)
        ax.set(xlabel="KL(p || q)", ylabel="std of a one-sample estimate", title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("k1 vs k3 as the distributions move apart (dots: Monte Carlo, 200k samples)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_length_penalty(path: str) -> None:
    import jax.numpy as jnp
    import numpy as np

    from composer_jax.rl import length_penalty

    plt = _pyplot()
    x = np.linspace(0, 20_000, 401)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for k, q in LENGTH_PARAMS:
        c = np.asarray(length_penalty(jnp.asarray(x), k, q))
        label = f"k={k:g}, q={q:g}" + (" (log)" if q == 1 else " (linear)" if q == 0 else "")
        ax.plot(x, c, label=label)
    ax.set(xlabel="weighted length x", ylabel="C(x)", ylim=(0, 8000))
    ax.set_title("Length penalty C(x) = ((1 + kx)^(1-q) - 1) / (k(1-q))")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv):
    del argv
    os.makedirs(FLAGS.out, exist_ok=True)
    categorical = estimator_spread(FLAGS.vocab, FLAGS.samples)
    gaussian = gaussian_spread(FLAGS.samples)
    print("Categorical setting:\n" + markdown_table(categorical, "distance"))
    print("\nGaussian setting:\n" + markdown_table(gaussian, "mu"))
    spread_path = os.path.join(FLAGS.out, "kl_k1_vs_k3_spread.png")
    plot_spread(categorical, gaussian, spread_path)
    length_path = os.path.join(FLAGS.out, "length_penalty_curves.png")
    plot_length_penalty(length_path)
    print(f"\nwrote {spread_path} and {length_path}")


if __name__ == "__main__":  # flags only when run, so tests can import the functions
    flags.DEFINE_string("out", "experiments/figures", "Folder for the PNGs.")
    flags.DEFINE_integer("vocab", 32, "Categorical size of the toy policy.")
    flags.DEFINE_integer("samples", 200_000, "Monte-Carlo samples per distance.")
    app.run(main)
