"""DeepSeek-V3's sequence-wise balance loss on the tiny model: off, the paper's weight (1e-4) and
a hundred times it, three seeds each, with the aux-loss-free bias balancing on in every run.
One phase of 200 steps at 8 x 128 tokens; about half a minute a run on 2 CPU cores.

  python -m launch.sweep --sweep=experiments/sweeps/balance_loss_tiny.py --root=runs/balance \
      --compare
"""


def get_sweep():
    return {
        "entry": "pretrain",
        "base": "tiny",
        "fixed": {
            "steps": 200,
            "train.phases": [{"name": "main", "seq_len": 128, "batch_size": 8}],
            "train.log_every": 1,
            "train.eval_every": 50,
            "train.checkpoint_every": 200,
        },
        "product": {"model.balance_loss_alpha": [0.0, 1e-4, 1e-2]},
        "seeds": [0, 1, 2],
        "compare": {
            "metrics": ["eval_nll", "ce", "expert_load_max_over_mean", "balance_loss"],
            "curves": ["expert_load_max_over_mean"],
        },
    }
