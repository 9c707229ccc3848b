r"""Tiny-model pretraining in bf16 vs low-precision experts: do the loss curves agree?

Runs of one seed share the initialisation, data order (the stdlib code corpus) and schedule; only
`model.expert_precision` differs. Prints the mean training loss over windows of steps and the
held-out NLL of seed 0's bf16 and nvfp4_fwd_mxfp8_bwd runs and saves their curves with the
relative gap; with several `--seeds`, every precision runs for each seed and a table gives each
one's final held-out NLL (mean and 95% Student-t interval over seeds) and its paired difference
from bf16 (the same seed's bf16 run).

  python experiments/lowprec_training.py [--steps=200] [--seeds=0,1,2] [--workdir=runs/lowprec]
      [--plot=experiments/figures/lowprec_training.png]
"""

import dataclasses
import json
import os
import shutil

from absl import app, flags

_STEPS = flags.DEFINE_integer("steps", 200, "Training steps per run.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/lowprec", "Parent folder of the two runs.")
_PLOT = flags.DEFINE_string("plot", "experiments/figures/lowprec_training.png", "PNG path.")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds; each runs every precision.")
_PRECISIONS = ("bf16", "mxfp8", "nvfp4_fwd_mxfp8_bwd")


def run(precision: str, steps: int, workdir: str, seed: int = 0) -> list[dict]:
    """Train from scratch (any earlier run in the folder is removed); returns the JSONL records."""
    from composer_jax import config as config_lib
    from composer_jax import presets
    from composer_jax.train.loop import run_pretraining

    base = presets.tiny()
    phase = config_lib.PhaseConfig(name="main", fraction=1.0, seq_len=128, batch_size=8)
    cfg = dataclasses.replace(
        base,
        steps=steps,
        seed=seed,
        workdir=os.path.join(workdir, f"seed{seed}", precision),
        model=dataclasses.replace(base.model, expert_precision=precision),
        train=dataclasses.replace(
            base.train, phases=(phase,), log_every=1, eval_every=50, checkpoint_every=steps
        ),
    )
    shutil.rmtree(cfg.workdir, ignore_errors=True)
    run_pretraining(cfg, progress=False)
    with open(os.path.join(cfg.workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def _interval(values) -> str:
    """mean [low, high], the 95% Student-t interval over the values."""
    import numpy as np
    from scipy import stats

    values = np.asarray(values, float)
    half = stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
    return f"{values.mean():.4f} [{values.mean() - half:.4f}, {values.mean() + half:.4f}]"


def _seed_table(final: dict, seeds: list[int]) -> str:
    """Markdown: each precision's final held-out NLL over seeds, and minus bf16 paired by seed."""
    lines = [
        f"| expert precision | held-out NLL ({len(seeds)} seeds) | minus bf16, paired |",
        "| --- | ---: | ---: |",
    ]
    for p in _PRECISIONS:
        nll = [final[(p, s)] for s in seeds]
        diff = [final[(p, s)] - final[("bf16", s)] for s in seeds]
        lines.append(f"| {p} | {_interval(nll)} | {'-' if p == 'bf16' else _interval(diff)} |")
    lines.append(
        "per seed: "
        + "; ".join(
            f"{s}: " + ", ".join(f"{p} {final[(p, s)]:.4f}" for p in _PRECISIONS) for s in seeds
        )
    )
    return "\n".join(lines)


def main(argv):
    del argv
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    seeds = [int(s) for s in _SEEDS.value]
    runs = {(p, s): run(p, _STEPS.value, _WORKDIR.value, s) for s in seeds for p in _PRECISIONS}
    records = {p: runs[(p, seeds[0])] for p in _PRECISIONS}
    losses = {p: np.asarray(_series(records[p], "loss")[1]) for p in _PRECISIONS}
    base, low = losses["bf16"], losses["nvfp4_fwd_mxfp8_bwd"]
    window = 20
    print(f"seed {seeds[0]}:")
    print(f"{'steps':>10} {'bf16 loss':>10} {'nvfp4 loss':>10} {'rel. gap':>9}")
    for start in range(0, len(base), window):
        b, q = base[start : start + window].mean(), low[start : start + window].mean()
        print(f"{start + 1:>4}-{start + window:<5} {b:>10.4f} {q:>10.4f} {(q - b) / b:>+9.2%}")
    for p in _PRECISIONS:
        steps, nll = _series(records[p], "eval_nll")
        print(f"eval NLL {p}: " + ", ".join(f"{s}:{v:.4f}" for s, v in zip(steps, nll)))
    if len(seeds) > 1:
        final = {key: _series(r, "eval_nll")[1][-1] for key, r in runs.items()}
        print(_seed_table(final, seeds))

    smooth = np.ones(10) / 10
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for p, color, style in zip(
        ("bf16", "nvfp4_fwd_mxfp8_bwd"), ("tab:blue", "tab:red"), ("-", "--")
    ):
        steps, _ = _series(records[p], "loss")
        top.plot(steps, losses[p], color=color, alpha=0.2)
        mean = np.convolve(losses[p], smooth, "valid")
        top.plot(steps[9:], mean, color=color, ls=style, label=f"{p} (10-step mean)")
    top.set_ylabel("training loss")
    top.legend()
    gap = np.convolve((low - base) / base, smooth, "valid")
    bottom.plot(steps[9:], 100 * gap)
    bottom.axhline(0, color="gray", lw=0.5)
    bottom.set_ylabel("nvfp4 - bf16 (% of bf16, 10-step mean)")
    bottom.set_xlabel("step")
    fig.suptitle("Tiny MoE: NVFP4 forward / MXFP8 backward experts vs bf16")
    fig.tight_layout()
    os.makedirs(os.path.dirname(_PLOT.value) or ".", exist_ok=True)
    fig.savefig(_PLOT.value, dpi=120)
    print(f"saved {_PLOT.value}")


if __name__ == "__main__":
    app.run(main)
