"""The coding agent (`python -m launch.rl --config=rl_agent_tiny`: 800 SFT steps on the scripted
agent's episodes, then 16 asynchronous RL steps of multi-turn episodes in small repositories)
with three seeds. The comparison's held-out table is the report's fig. 5 over the seeds: reward,
pass@1, best-of-8, turns, tool calls, summaries, feedback turns and each behaviour reward before
and after RL.

  python -m launch.sweep --sweep=experiments/sweeps/agent_seeds.py --root=runs/claims/agent \
      --parallel=2 --compare
"""


def get_sweep():
    return {
        "entry": "rl",
        "base": "rl_agent_tiny",
        "seeds": [0, 1, 2],
        "compare": {
            "metrics": ["warm_start/loss", "heldout_before", "heldout_after", "heldout_gain"],
            "curves": ["rollout_reward", "kl_k1", "length_penalty"],
        },
    }
