r"""QK-clip (MuonClip) on the tiny model: does it hold the attention logits, and at what cost?

Pretrains the tiny preset with Muon from scratch per seed without and with each of the
`optim.qk_clip_threshold`s; runs of one seed share initialisation, data order and schedule. Each
run's metrics.jsonl has the step's largest attention logit (`attention_max_logit`, before the
clip) and the heads it rescaled (`qk_clipped_heads`). Prints, per arm, the largest logit over the
run and over its last tenth, the share of steps that clipped, and the final held-out NLL (mean and
95% Student-t interval over seeds, and paired by seed against no clip); saves every run's
largest logit per step and each threshold's training loss minus no clip's (mean over seeds).

  python -m experiments.qk_clip_training [--steps=300] [--seeds=0,1,2] [--thresholds=30,20,10]
      [--muon_lr=0.05] [--workdir=runs/qk_clip] [--plot=experiments/figures/qk_clip.png]
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import matplotlib
import numpy as np
from absl import app, flags

from composer_jax import config as config_lib
from composer_jax import presets
from composer_jax.eval.passk import mean_interval
from composer_jax.train.loop import run_pretraining

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file backend)

_STEPS = flags.DEFINE_integer("steps", 300, "Training steps per run.")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds; each runs every arm.")
_THRESHOLDS = flags.DEFINE_list("thresholds", ["30", "20", "10"], "QK-clip thresholds to run.")
_MUON_LR = flags.DEFINE_float("muon_lr", 0.05, "Muon's peak learning rate (both arms).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/qk_clip", "Parent folder of the runs.")
_PLOT = flags.DEFINE_string("plot", "experiments/figures/qk_clip.png", "PNG path.")


def run(threshold: float, seed: int) -> list[dict]:
    """Train from scratch (an earlier run in the folder is removed); returns the JSONL records."""
    base = presets.tiny()
    phase = config_lib.PhaseConfig(name="main", fraction=1.0, seq_len=128, batch_size=8)
    cfg = dataclasses.replace(
        base,
        steps=_STEPS.value,
        seed=seed,
        workdir=os.path.join(_WORKDIR.value, f"seed{seed}", f"clip{threshold:g}"),
        optim=dataclasses.replace(
            base.optim,
            name="muon",
            muon_learning_rate=_MUON_LR.value,
            qk_clip_threshold=threshold,
        ),
        train=dataclasses.replace(
            base.train, phases=(phase,), log_every=1, eval_every=50, checkpoint_every=_STEPS.value
        ),
    )
    shutil.rmtree(cfg.workdir, ignore_errors=True)
    run_pretraining(cfg, progress=False)
    with open(os.path.join(cfg.workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    points = [(r["step"], r[key]) for r in records if key in r]
    return np.asarray([p[0] for p in points]), np.asarray([p[1] for p in points], float)


def _interval(values) -> str:
    mean, half = mean_interval(list(values))
    return f"{mean:.4f} [{mean - half:.4f}, {mean + half:.4f}]"


def _table(runs: dict, arms: list[float], seeds: list[int]) -> str:
    """Markdown: per arm the logits it reached, how often it clipped, its held-out NLL."""
    lines = [
        f"| QK-clip threshold | largest logit (max over seeds) | last 10% of steps | steps "
        f"clipping | held-out NLL ({len(seeds)} seeds) | minus no clip, paired |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    final = {key: _series(r, "eval_nll")[1][-1] for key, r in runs.items()}
    for arm in arms:
        logits = [_series(runs[(arm, s)], "attention_max_logit")[1] for s in seeds]
        tail = max(x[-max(1, len(x) // 10) :].max() for x in logits)
        clipping = [
            np.mean(_series(runs[(arm, s)], "qk_clipped_heads")[1] > 0) if arm else 0.0
            for s in seeds
        ]
        diff = [final[(arm, s)] - final[(0.0, s)] for s in seeds]
        name = "off" if arm == 0 else f"{arm:g}"
        lines.append(
            f"| {name} | {max(x.max() for x in logits):.1f} | {tail:.1f} | {np.mean(clipping):.0%} | "
            f"{_interval(final[(arm, s)] for s in seeds)} | "
            f"{'-' if arm == 0 else _interval(diff)} |"
        )
    lines.append(
        "per seed (held-out NLL): "
        + "; ".join(f"{s}: " + ", ".join(f"{a:g} {final[(a, s)]:.4f}" for a in arms) for s in seeds)
    )
    return "\n".join(lines)


def _plot(runs: dict, arms: list[float], seeds: list[int]) -> None:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 7), sharex=True)
    colors = dict(zip(arms, ("black", "tab:blue", "tab:orange", "tab:red", "tab:green")))
    window = 20
    for arm in arms:
        name = "no clip" if arm == 0 else f"QK-clip {arm:g}"
        for i, seed in enumerate(seeds):
            steps, logits = _series(runs[(arm, seed)], "attention_max_logit")
            top.plot(
                steps, logits, color=colors[arm], alpha=0.6, lw=0.8, label=name if i == 0 else None
            )
        if arm:
            top.axhline(arm, color=colors[arm], ls="--", lw=0.6)
            gaps = [
                _series(runs[(arm, s)], "loss")[1] - _series(runs[(0.0, s)], "loss")[1]
                for s in seeds
            ]
            smooth = np.convolve(np.mean(gaps, axis=0), np.ones(window) / window, "valid")
            bottom.plot(steps[window - 1 :], smooth, color=colors[arm], label=name)
    top.set_ylabel("largest attention logit of the step")
    top.legend()
    bottom.axhline(0, color="gray", lw=0.5)
    bottom.set_ylabel(f"training loss minus no clip\n({window}-step mean, mean of seeds)")
    bottom.set_xlabel("step")
    bottom.legend()
    fig.suptitle(f"Tiny MoE, Muon lr {_MUON_LR.value:g}, {len(seeds)} seeds")
    fig.tight_layout()
    os.makedirs(os.path.dirname(_PLOT.value) or ".", exist_ok=True)
    fig.savefig(_PLOT.value, dpi=120)
    print(f"saved {_PLOT.value}")


def main(argv):
    del argv
    seeds = [int(s) for s in _SEEDS.value]
    arms = [0.0, *(float(t) for t in _THRESHOLDS.value)]
    runs = {(arm, seed): run(arm, seed) for seed in seeds for arm in arms}
    print(_table(runs, arms, seeds))
    _plot(runs, arms, seeds)


if __name__ == "__main__":
    app.run(main)
