# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Comparing the runs of a sweep
#
# `data/` holds the records (config, metrics, held-out evaluations; no checkpoints) of two real
# sweeps run on a 2-core CPU:
# - `lr_seed`: tiny pretraining, learning rate x seed, 12 steps
#   (`python -m launch.sweep --sweep=experiments/sweeps/lr_seed_tiny.py --root=runs/lr_seed`);
# - `warm_start_rl`: the same short RL from SFT warm starts of 100, 200 and 400 steps, 3 seeds
#   (`experiments/sweeps/warm_start_rl.py`).
#
# Point `sweep_root` at your own sweep's `--root` to look at yours. `python -m launch.compare DIR`
# writes the same table and figures from the command line.

# %%
import matplotlib.pyplot as plt
from IPython.display import Markdown

from composer_jax.eval import compare

sweep_root = "data/lr_seed"
runs = [compare.load_run(path) for path in compare.find_runs([sweep_root])]
groups = compare.group_runs(runs)  # runs that differ only by seed
[(g.label, g.seeds) for g in groups]

# %% [markdown]
# Final values, mean +- 95% interval over seeds (Student's t: two seeds make a wide interval).

# %%
table, rows = compare.summary_table(groups, ["loss", "eval_nll"])
Markdown(table)

# %%
compare.draw_curves(groups, ["loss", "eval_nll"])
plt.show()

# %% [markdown]
# ## RL runs: held-out reward before and after RL, paired by task
#
# An RL run's `heldout.json` holds the reward of each held-out task before RL and after it.
# Runs of the same seed share their held-out tasks, so two groups are compared task by task.

# %%
rl_runs = [compare.load_run(p) for p in compare.find_runs(["data/warm_start_rl"])]
rl_groups = compare.group_runs(rl_runs)
metrics = [
    "warm_start/loss",
    "warm_start/eval_nll",
    "heldout_before",
    "heldout_after",
    "heldout_gain",
]
table, _ = compare.summary_table(rl_groups, metrics)
Markdown(table)

# %%
differences, _ = compare.differences_table(rl_groups, baseline=0)
Markdown(differences)

# %% [markdown]
# Does the warm start's loss predict the reward after RL? One point per run:

# %%
stats = compare.draw_scatter(rl_groups, "warm_start/loss", "heldout_after")
{k: v for k, v in stats.items() if k != "ax"}
