"""The coding agent preset (`rl_agent_tiny`) over three seeds, its held-out check on 128 functions
(8 samples each) instead of 32: the paired interval of the RL change in pass@1 shrinks by half
(with the square root of the task pairs), enough to tell a change of +0.01 from zero. Each run
keeps its warm start (`<run>/warm_start`), from which RL levers can start (zip `seed` with
`rl.warm_start`, see launch/sweep.py).

  python -m launch.sweep --sweep=experiments/sweeps/agent_heldout128.py \
      --root=runs/claims/agent128 --parallel=1 --compare
"""


def get_sweep():
    return {
        "entry": "rl",
        "base": "rl_agent_tiny",
        "fixed": {"rl.heldout.num_tasks": 128},
        "seeds": [0, 1, 2],
        "compare": {
            "metrics": ["warm_start/loss", "heldout_before", "heldout_after", "heldout_gain"],
            "curves": ["rollout_reward", "kl_k1", "length_penalty"],
        },
    }
