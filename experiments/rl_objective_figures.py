r"""Figures for the RL objective: k1 vs k3 spread as two policies move apart, length penalty curves.

  python experiments/rl_objective_figures.py [--out=experiments/figures] [--vocab=32]

k1 = log(pi/ref) and k3 = (r - 1) - log r (r = ref/pi) are both unbiased estimates of
KL(pi || ref) from a token y ~ pi; their standard deviations are computed exactly over a categorical
(and checked by Monte Carlo), for a reference that drifts further from the policy.
"""

import os

from absl import app, flags

_OUT = flags.DEFINE_string("out", "experiments/figures", "Folder for the PNGs.")
_VOCAB = flags.DEFINE_integer("vocab", 32, "Categorical size of the toy policy.")
_SAMPLES = flags.DEFINE_integer("samples", 200_000, "Monte-Carlo samples per distance.")

LENGTH_PARAMS = ((1e-3, 0.0), (1e-3, 0.5), (1e-3, 1.0), (1e-3, 1.5), (1e-3, 2.0), (1e-4, 1.5))


def estimator_spread(vocab: int, samples: int) -> list[dict]:
    """Exact KL, and exact and Monte-Carlo std of k1 and k3, as the reference moves away."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from composer_jax.rl import kl_estimate

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
        exact = {
            "k1": log_ratio,
            "k3": np.expm1(-log_ratio) + log_ratio,
        }
        key = jax.random.key(int(distance * 1000))
        ys = jax.random.categorical(key, jnp.asarray(np.log(pi)), shape=(samples,))
        logp = jnp.asarray(np.log(pi), jnp.float32)[ys]
        ref_logp = jnp.asarray(np.log(ref), jnp.float32)[ys]
        row = {"distance": float(distance), "kl": kl}
        for name, values in exact.items():
            row[f"{name}_std"] = float(np.sqrt(pi @ (values - kl) ** 2))
            mc = np.asarray(kl_estimate(logp, ref_logp, name), np.float64)
            row[f"{name}_mc_mean"] = float(mc.mean())
            row[f"{name}_mc_std"] = float(mc.std())
        rows.append(row)
    return rows


def plot_spread(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kl = [r["kl"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, style in (("k1", "o-"), ("k3", "s-")):
        axes[0].loglog(kl, [r[f"{name}_std"] for r in rows], style, label=f"{name} (exact)")
        axes[0].loglog(kl, [r[f"{name}_mc_std"] for r in rows], "k.", ms=3)
        axes[1].semilogx(kl, [r[f"{name}_std"] / r["kl"] for r in rows], style, label=name)
    axes[0].set(xlabel="KL(pi || ref)", ylabel="std of one-sample estimate", title="Spread")
    axes[1].set(xlabel="KL(pi || ref)", ylabel="std / KL", yscale="log", title="Relative spread")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("k1 vs k3 estimators of KL as the policies move apart (dots: Monte Carlo)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_length_penalty(path: str) -> None:
    import jax.numpy as jnp
    import matplotlib
    import numpy as np

    from composer_jax.rl import length_penalty

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    os.makedirs(_OUT.value, exist_ok=True)
    rows = estimator_spread(_VOCAB.value, _SAMPLES.value)
    print(f"{'KL':>9} {'std k1':>9} {'std k3':>9} {'mc mean k1':>11} {'mc mean k3':>11}")
    for r in rows:
        print(
            f"{r['kl']:9.4f} {r['k1_std']:9.4f} {r['k3_std']:9.4f} "
            f"{r['k1_mc_mean']:11.4f} {r['k3_mc_mean']:11.4f}"
        )
    spread_path = os.path.join(_OUT.value, "kl_k1_vs_k3_spread.png")
    plot_spread(rows, spread_path)
    length_path = os.path.join(_OUT.value, "length_penalty_curves.png")
    plot_length_penalty(length_path)
    print(f"wrote {spread_path} and {length_path}")


if __name__ == "__main__":
    app.run(main)
