r"""AdamW vs Muon on the tiny model: same data, same steps, same schedule shape.

Both runs see the identical stream of packed stdlib-code batches (read once, reused) and are
evaluated on the same held-out batches. Muon uses the AdamW-matched RMS scaling
(0.2 * sqrt(max(A, B))), so by default it shares AdamW's learning rate and weight decay; further
Muon learning rates can be added. Saves loss curves to a PNG and prints the final eval NLLs side
by side.

  python experiments/ablate_muon.py [--steps=300] [--muon_lrs=3e-3,1e-2]
      [--plot=experiments/figures/muon_vs_adamw.png]
"""

import dataclasses
import functools
import time

from absl import app, flags

_STEPS = flags.DEFINE_integer("steps", 300, "Optimizer steps per run.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step.")
_SEQ = flags.DEFINE_integer("seq_len", 128, "Tokens per sequence.")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 25, "Steps between held-out evaluations.")
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", 8, "Held-out batches per evaluation.")
_MUON_LRS = flags.DEFINE_list("muon_lrs", ["3e-3", "1e-2"], "Muon peak learning rates to run.")
_PLOT = flags.DEFINE_string("plot", "experiments/figures/muon_vs_adamw.png", "Output PNG.")


def _batches(split: str, count: int, seed: int) -> list[dict]:
    import numpy as np

    from composer_jax import data as data_lib

    corpus = data_lib.CodeCorpus(data_lib.default_code_root(), split=split, eval_fraction=0.02)
    tokenizer = data_lib.get_tokenizer("byte")
    dataset = data_lib.make_pretrain_dataset(corpus, tokenizer, _SEQ.value, _BATCH.value, seed)
    it = iter(dataset)
    return [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(count)]


def run(name: str, optim_cfg, train_batches, eval_batches) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from composer_jax import config as config_lib
    from composer_jax import optim, presets
    from composer_jax.model import init_model
    from composer_jax.model.layers import logical_axes_of
    from composer_jax.train import step as step_lib

    model_cfg = presets.tiny().model
    train_cfg = config_lib.TrainConfig()
    schedule = optim.learning_rate_schedule(optim_cfg, len(train_batches))
    m = init_model(model_cfg, seed=0)
    axes = logical_axes_of(nnx.state(m, nnx.Param))
    optimizer = optim.make_optimizer(optim_cfg, schedule, axes, verbose=False)
    graphdef, _, _ = step_lib.split_model(m)
    state = step_lib.init_train_state(m, optimizer)
    train = jax.jit(
        functools.partial(
            step_lib.train_step, graphdef, optimizer, model_cfg, train_cfg, schedule, None
        ),
        donate_argnums=0,
    )
    evaluate = jax.jit(functools.partial(step_lib.eval_step, graphdef, None))

    def eval_nll(state) -> float:
        outs = [evaluate(state, b) for b in eval_batches]
        return float(sum(o["nll_sum"] for o in outs) / sum(o["tokens"] for o in outs))

    losses, evals = [], [(0, eval_nll(state))]
    t0 = time.perf_counter()
    for step, batch in enumerate(train_batches, start=1):
        state, metrics = train(state, batch)
        losses.append(float(metrics["ce"]))
        if not np.isfinite(losses[-1]):
            raise FloatingPointError(f"{name}: non-finite loss at step {step}")
        if step % _EVAL_EVERY.value == 0 or step == len(train_batches):
            evals.append((step, eval_nll(state)))
            print(
                f"{name:<22} step {step:4d}  train CE {losses[-1]:.3f}  eval NLL {evals[-1][1]:.3f}"
            )
    return {"losses": losses, "evals": evals, "seconds": time.perf_counter() - t0}


def main(_):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from composer_jax import presets

    train_batches = _batches("train", _STEPS.value, seed=0)
    eval_batches = _batches("eval", _EVAL_BATCHES.value, seed=1)
    base = presets.tiny().optim
    runs = {f"adamw lr={base.learning_rate:g}": base}
    for lr in _MUON_LRS.value:
        runs[f"muon lr={float(lr):g}"] = dataclasses.replace(
            base, name="muon", muon_learning_rate=float(lr)
        )
    results = {name: run(name, cfg, train_batches, eval_batches) for name, cfg in runs.items()}

    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(11, 4))
    window = 10
    for name, r in results.items():
        smooth = np.convolve(r["losses"], np.ones(window) / window, mode="valid")
        ax_train.plot(np.arange(window, len(r["losses"]) + 1), smooth, label=name)
        steps, nll = zip(*r["evals"])
        ax_eval.plot(steps, nll, marker="o", ms=3, label=name)
    ax_train.set(xlabel="step", ylabel=f"train CE ({window}-step mean)", title="tiny model")
    ax_eval.set(xlabel="step", ylabel="held-out NLL (nats/byte)", title="held-out")
    for ax in (ax_train, ax_eval):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(_PLOT.value, dpi=120)
    print(f"\nsaved {_PLOT.value}\n")
    print(f"{'run':<22} {'final eval NLL':>15} {'best eval NLL':>14} {'train s':>8}")
    for name, r in results.items():
        final, best = r["evals"][-1][1], min(v for _, v in r["evals"])
        print(f"{name:<22} {final:>15.4f} {best:>14.4f} {r['seconds']:>8.1f}")


if __name__ == "__main__":
    app.run(main)
