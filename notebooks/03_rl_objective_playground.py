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
# # The RL objective on toy groups
#
# The pieces of `composer_jax.rl` that turn rewards into a gradient signal, on numbers small
# enough to read: group advantages, KL estimators, the length penalty. Nothing here needs a model.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from composer_jax import rl


def show(values):
    """Rounded for reading."""
    return np.round(np.asarray(values, np.float64), 3)


# %% [markdown]
# ## Advantages
# Two prompts, four samples each. The baseline is the group's mean reward (Dr. GRPO); dividing by
# the group's std (`mean_std`) is the ablation: it blows up a group whose rewards barely differ.

# %%
rewards = jnp.array([1.0, 0.0, 0.0, 1.0, 0.52, 0.50, 0.50, 0.48])
groups = jnp.array([0, 0, 0, 0, 1, 1, 1, 1])
for mode in ("mean", "leave_one_out", "mean_std"):
    print(f"{mode:14}", show(rl.group_advantages(rewards, groups, mode)))

# %% [markdown]
# ## KL estimators
# Tokens sampled from the policy `pi`; `k1 = log pi/ref` and `k3 = (r - 1) - log r` (r = ref/pi)
# are both unbiased for KL(pi || ref). Here `pi` and `ref` are unit-variance Gaussians `mu` apart
# (KL = mu^2 / 2): k1's spread grows like mu, k3's like exp(mu^2 / 2).

# %%
key = jax.random.key(0)
x = jax.random.normal(key, (200_000,))  # samples of pi = N(0, 1)
rows = []
for mu in np.linspace(0.25, 3.0, 12):
    logp = -0.5 * x**2
    ref_logp = -0.5 * (x - mu) ** 2
    k1 = rl.kl_estimate(logp, ref_logp, "k1")
    k3 = rl.kl_estimate(logp, ref_logp, "k3")
    rows.append((mu**2 / 2, float(k1.mean()), float(k1.std()), float(k3.mean()), float(k3.std())))
rows = np.array(rows)
fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
ax[0].plot(rows[:, 0], rows[:, 0], "k--", label="true KL")
ax[0].plot(rows[:, 0], rows[:, 1], "o-", label="k1 mean")
ax[0].plot(rows[:, 0], rows[:, 3], "s-", label="k3 mean")
ax[1].semilogy(rows[:, 0], rows[:, 2], "o-", label="k1 std")
ax[1].semilogy(rows[:, 0], rows[:, 4], "s-", label="k3 std")
for a in ax:
    a.set_xlabel("KL(pi || ref)")
    a.legend()
    a.grid(alpha=0.3)
ax[0].set_title("means over 200k samples")
ax[1].set_title("one-sample spread")
plt.show()

# %% [markdown]
# ## Length penalty
# C(x) = ((1 + kx)^(1-q) - 1) / (k(1-q)): linear for short samples, flatter for long ones when
# q > 0 (q = 1 is log(1 + kx)/k). The reward is task reward - coef * C(x), so inside a group the
# penalty only moves advantages by the *differences* of C between samples.

# %%
x = jnp.linspace(0, 20_000, 201)
for q in (0.0, 0.5, 1.0, 1.5):
    plt.plot(x, rl.length_penalty(x, 1e-3, q), label=f"q={q}")
plt.xlabel("weighted length x")
plt.ylabel("C(x)")
plt.legend()
plt.show()

# %%
lengths = jnp.array([300.0, 600.0, 3000.0, 12000.0])  # four samples of one prompt, all correct
task_reward = jnp.ones(4)
group = jnp.zeros(4, jnp.int32)
for q in (0.0, 1.5):
    total = task_reward - 1e-4 * rl.length_penalty(lengths, 1e-3, q)
    print(f"q={q}: rewards", show(total), "advantages", show(rl.group_advantages(total, group)))
