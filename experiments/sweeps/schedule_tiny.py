"""The learning-rate schedule on the tiny model: cosine over the whole run against
warmup-stable-decay (the peak held, then cosine over the last 20% or 35% of the steps, as
DeepSeek-V3 and Kimi K2), three seeds each. One phase of 300 steps at 8 x 128 tokens; about half
a minute a run on 2 CPU cores.

  python -m launch.sweep --sweep=experiments/sweeps/schedule_tiny.py --root=runs/schedule \
      --compare
"""


def get_sweep():
    return {
        "entry": "pretrain",
        "base": "tiny",
        "fixed": {
            "steps": 300,
            "train.phases": [{"name": "main", "seq_len": 128, "batch_size": 8}],
            "train.log_every": 1,
            "train.eval_every": 50,
            "train.checkpoint_every": 300,
        },
        "zip": {  # cosine ignores decay_fraction
            "optim.schedule": ["cosine", "wsd", "wsd"],
            "optim.decay_fraction": [0.2, 0.2, 0.35],
        },
        "seeds": [0, 1, 2],
        "compare": {"metrics": ["eval_nll", "ce"], "curves": ["eval_nll", "lr"]},
    }
