r"""Which reward part drives an RL run's policy gradient, read back from its ledger.

  python experiments/advantage_shares.py runs/claims/agent128/seed=0 [RUN ...] [--json=PATH]

For each run, every group its trainer consumed (`ledger/`) is packed alone and rewarded as the
trainer rewards it (`actor.samples.group_alone`, `rl.length_penalty.parts_advantage_rms`); each part's
`advantage_rms` (the rms over samples of the part minus its group's mean: the share of the
Dr. GRPO advantage it carries) is pooled over the run, with the fraction of groups whose task
rewards differ (the only ones where the task reward carries any advantage). Runs since the
trainer logs `advantage_rms/<part>` per step have the same numbers in `metrics.jsonl`; this reads
older runs too. The KL term's share needs the trainer's log-probs and is not recomputed.
"""

import collections
import json
import math
import os

import numpy as np
from absl import app, flags

from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.samples import group_alone, trained_samples
from composer_jax.rl.length_penalty import parts_advantage_rms
from composer_jax.train.workdir import read_run_config

_JSON = flags.DEFINE_string("json", "", "Also write the table as JSON to this path.")

PREFIX = "advantage_rms/"


def run_shares(workdir: str) -> dict:
    """The pooled `advantage_rms` of each reward part over the groups the run trained on."""
    cfg = read_run_config(workdir)
    ledger = GroupLedger(os.path.join(workdir, "ledger"))
    squares, samples, groups, task_signal = collections.Counter(), 0, 0, 0
    for group_id in ledger:
        if ledger.trained_step(group_id) is None:
            continue
        group = ledger.load(group_id)
        batch = group_alone(group, cfg.rl)
        metrics = parts_advantage_rms(batch, cfg.rl.objective)
        # The rms is over the samples in the advantages: abandoned ones are not.
        trained = trained_samples(group)
        count = int(trained.sum())
        for name, value in metrics.items():
            if name.startswith(PREFIX):
                squares[name[len(PREFIX) :]] += float(value) ** 2 * count
        task = np.asarray(batch.rewards_N["task"])[: len(trained)][trained]
        task_signal += bool(task.size and np.ptp(task) > 0)
        samples, groups = samples + count, groups + 1
    if not groups:
        raise SystemExit(f"{workdir}: no trained groups in its ledger")
    rms = {name: math.sqrt(total / samples) for name, total in squares.items()}
    return {"groups": groups, "task_signal": task_signal / groups, "advantage_rms": rms}


def main(argv):
    runs = argv[1:]
    if not runs:
        raise app.UsageError("name one or more RL run folders")
    table = {run: run_shares(run) for run in runs}
    parts = sorted({p for r in table.values() for p in r["advantage_rms"]})
    print("| run | groups | groups with task signal | " + " | ".join(parts) + " |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in parts) + " |")
    for run, r in table.items():
        cells = [f"{r['advantage_rms'].get(p, float('nan')):.3f}" for p in parts]
        print(f"| {run} | {r['groups']} | {r['task_signal']:.2f} | " + " | ".join(cells) + " |")
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    app.run(main)
