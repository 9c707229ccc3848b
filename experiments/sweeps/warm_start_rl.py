"""Does pretraining loss predict RL reward? The same short RL from SFT warm starts of different
lengths (the warm start is `rl.warm_start_steps` steps of SFT on the built-in tasks, its own
cosine schedule), three seeds each. Sized for a shared 2-core CPU (about 5 minutes a run):
groups of 8, every group trained (no dynamic sampling, so a warm start that solves nothing still
takes its steps), 8 RL steps, 24 held-out tasks x 2 samples.

  python -m launch.sweep --sweep=experiments/sweeps/warm_start_rl.py --root=runs/claims/warm_start_rl \
      --parallel=2 --compare --compare_out=experiments/figures/warm_start_rl
  (the comparison includes the scatter of held-out reward after RL against the warm start's loss)
"""


def get_sweep():
    return {
        "entry": "rl",
        "base": "rl_tiny",
        "fixed": {
            "steps": 8,
            "rl.rollout.group_size": 8,
            "rl.rollout.groups_per_step": 2,
            "rl.rollout.skip_uniform_groups": False,
            "rl.heldout.num_tasks": 24,
            "rl.heldout.samples": 2,
            "train.checkpoint_every": 4,
        },
        "product": {"rl.warm_start_steps": [100, 200, 400]},
        "seeds": [0, 1, 2],
        "compare": {
            "metrics": [
                "warm_start/loss",
                "warm_start/eval_nll",
                "heldout_before",
                "heldout_after",
                "heldout_gain",
            ],
            "curves": ["rollout_reward", "kl_k1"],
            "scatter": ("warm_start/loss", "heldout_after"),
        },
    }
