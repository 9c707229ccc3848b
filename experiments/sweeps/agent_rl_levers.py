"""RL levers for the coding agent, each from the three warm starts of `agent_heldout128.py`
(so the held-out check, 128 functions x 8 samples with the same keys, sees the same policy
before RL in every row and the rows compare paired by task):

  task_only  the advantage from the task reward alone: no length penalty, no behaviour rewards
             but the reward-hacking one (`harm`, zero unless the agent games the tests)

  python -m launch.sweep --sweep=experiments/sweeps/agent_rl_levers.py \
      --root=runs/claims/agent128_levers --parallel=1
  python -m launch.compare runs/claims/agent128 runs/claims/agent128_levers --ignore=rl.warm_start
"""

WARM_STARTS = "runs/claims/agent128/seed={}/warm_start"
SEEDS = [0, 1, 2]


def get_sweep():
    return {
        "entry": "rl",
        "base": "rl_agent_tiny",
        "fixed": {
            "rl.heldout.num_tasks": 128,
            "rl.objective.length_penalty_coef": 0.0,
            "rl.agent.behaviour_rewards": ("harm=0.5",),
        },
        "zip": {"seed": SEEDS, "rl.warm_start": [WARM_STARTS.format(s) for s in SEEDS]},
        "compare": {"metrics": ["heldout_before", "heldout_after", "heldout_gain"]},
    }
