"""The main job (`python -m launch.rl`, preset rl_tiny: 500 SFT steps, then 24 asynchronous RL
steps of 8 groups x 4 with dynamic sampling) with three seeds. About 10 minutes a run alone on 2
CPU cores. experiments/rl_best_of_k.py evaluates pass@1..16 before and after its RL.

  python -m launch.sweep --sweep=experiments/sweeps/main_job_seeds.py --root=runs/claims/main_job \
      --parallel=2 --compare
"""


def get_sweep():
    return {
        "entry": "rl",
        "base": "rl_tiny",
        "seeds": [0, 1, 2],
        "compare": {
            "metrics": ["warm_start/loss", "heldout_before", "heldout_after", "heldout_gain"],
            "curves": ["rollout_reward", "kl_k1", "length_penalty"],
        },
    }
