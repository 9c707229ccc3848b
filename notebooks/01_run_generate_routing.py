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
# # A run: train, load, generate, look at the routing
#
# Trains the tiny model for a few steps (seconds on a CPU), loads the run back, generates text,
# and looks at which experts its MoE layers pick. With a run you trained elsewhere, skip the
# training cell and give `train.load_run` its workdir; with a Hugging Face DeepSeek-V3-format
# folder, use `interop.load_hf_checkpoint(folder)` and `data.load_tokenizer(folder)` (the last
# cells export this run as one and load it back).

# %%
import dataclasses
import tempfile

import matplotlib.pyplot as plt

from composer_jax import config, data, infer, interop, presets, train
from composer_jax.eval import routing

run_folder = tempfile.TemporaryDirectory(prefix="notebook_run_")  # removed when the kernel exits
workdir = run_folder.name
base = presets.tiny()
cfg = dataclasses.replace(
    base,
    steps=20,
    workdir=workdir,
    train=dataclasses.replace(
        base.train,
        phases=(config.PhaseConfig("main", seq_len=64, batch_size=4),),
        log_every=5,
        eval_every=20,
        eval_batches=1,
    ),
)
result = train.run_pretraining(cfg, progress=False)
result.eval_nll_start, result.eval_nll_end

# %% [markdown]
# The run's folder holds its config, metrics, checkpoints and tokenizer; `load_run` reads them
# back.

# %%
run = train.load_run(workdir)
print(run.step, run.config.model.num_experts, "experts,", run.tokenizer.vocab_size, "token ids")
plt.plot(
    [m["step"] for m in run.metrics if "loss" in m], [m["loss"] for m in run.metrics if "loss" in m]
)
plt.xlabel("step")
plt.ylabel("training loss")
plt.show()

# %% [markdown]
# Text in, text out (greedy at temperature 0; twenty steps of training make a poor poet).

# %%
infer.generate(run.model, run.tokenizer, ["def add(a, b):", "import os\n"], max_new_tokens=24)

# %% [markdown]
# Routing: the experts every MoE layer picks for each token of a text, and the load per expert.

# %%
text = "import os\n\n\ndef list_files(path):\n    return sorted(os.listdir(path))\n"
tokens = run.tokenizer.encode(text, add_bos=True)
stats = routing.routing_stats(run.model, tokens)
print(stats.table())
routing.plot_expert_load(stats, title="expert load on one snippet")
plt.show()

# %% [markdown]
# The experts each token went to in the first MoE layer (the router's order of preference):

# %%
for token, experts in list(zip(tokens[1:], stats.experts_LTK[0, 1:]))[:12]:
    print(repr(run.tokenizer.decode([token])), experts.tolist())

# %% [markdown]
# The same model as a Hugging Face folder (what `python -m launch.export` writes), loaded back
# the way any DeepSeek-V3-format checkpoint is.

# %%
hf_folder = tempfile.TemporaryDirectory(prefix="notebook_hf_")
hf_dir = hf_folder.name
interop.export_hf_checkpoint(run.model, hf_dir, run.tokenizer)
hf_model = interop.load_hf_checkpoint(hf_dir)
hf_tokenizer = data.load_tokenizer(hf_dir)
infer.generate(hf_model, hf_tokenizer, ["def add(a, b):"], max_new_tokens=24)
