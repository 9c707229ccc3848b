"""A 2 x 2 grid of short tiny pretraining runs (learning rate x seed): the smallest sweep that
`launch.compare` can group by seed. About a minute per run on 2 CPU cores.

  python -m launch.sweep --sweep=experiments/sweeps/lr_seed_tiny.py --root=runs/lr_seed --compare
"""


def get_sweep():
    return {
        "entry": "pretrain",
        "base": "tiny",
        "fixed": {
            "steps": 12,
            "train.phases": [{"name": "main", "seq_len": 64, "batch_size": 4}],
            "train.log_every": 2,
            "train.eval_every": 4,
            "train.eval_batches": 1,
            "train.checkpoint_every": 6,
        },
        "product": {"optim.learning_rate": [1e-3, 3e-3]},
        "seeds": [0, 1],
        "compare": {"metrics": ["loss", "eval_nll"], "curves": ["loss", "eval_nll"]},
    }
