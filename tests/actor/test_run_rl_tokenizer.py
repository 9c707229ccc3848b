"""`python -m launch.rl --config.rl.warm_start=RUN` on a BPE warm start: the run takes the warm
start's tokenizer, and the trained groups' token kinds (what the length penalty counts) are those
of the BPE tokens' text; a tokenizer that differs from the warm start's is refused."""

import os
import subprocess
import sys

import numpy as np
import pytest

from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.samples import group_sequences
from composer_jax.agent.kinds import token_kinds
from composer_jax.data import load_tokenizer
from composer_jax.rl import SegmentKind
from composer_jax.train.runs import run_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL_RL = (
    "--config.steps=2",
    "--config.rl.heldout.num_tasks=2",
    "--config.rl.heldout.samples=1",
    "--config.rl.rollout.group_size=2",
    "--config.rl.rollout.groups_per_step=2",
    "--config.rl.rollout.num_slots=4",
    "--config.rl.rollout.context_len=512",
    "--config.rl.rollout.max_new_tokens=32",
    "--config.rl.agent.max_turns=2",
    "--config.rl.rollout.num_prompts=0",
    "--config.rl.rollout.skip_uniform_groups=False",
    "--config.rl.rollout.env_workers=thread",
    "--progress=false",
)


def _run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


def _runs(mask):
    """(start, end) of the runs of True in `mask`."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[0::2], edges[1::2]))


@pytest.mark.slow
def test_rl_warm_start_brings_its_bpe_tokenizer(tmp_path):
    warm = str(tmp_path / "warm")
    done = _run(
        "launch.pretrain",
        "--config=experiments/configs/rl_tiny_bpe.py",
        f"--config.workdir={warm}",
        "--config.steps=3",
        "--config.train.eval_every=3",
        "--config.train.checkpoint_every=3",
        "--progress=false",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    bpe = load_tokenizer("code_bpe_2k")
    assert run_tokenizer(warm).fingerprint() == bpe.fingerprint()

    # The byte preset's config, pointed at the BPE warm start: data.tokenizer="auto" takes it.
    workdir = str(tmp_path / "rl")
    common = ("--config=experiments/configs/rl_tiny.py", "--config.model.vocab_size=2048")
    done = _run(
        "launch.rl",
        *common,
        f"--config.rl.warm_start={warm}",
        f"--config.workdir={workdir}",
        *SMALL_RL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert run_tokenizer(workdir).fingerprint() == bpe.fingerprint()
    ledger = GroupLedger(os.path.join(workdir, "ledger"))
    sequences = [s for gid in ledger for s in group_sequences(ledger.load(gid))]
    assert sequences
    for seq in sequences:
        for start, end in _runs(seq.policy_mask):  # each generated turn
            turn = seq.tokens[start:end]
            np.testing.assert_array_equal(seq.kinds[start:end], token_kinds(turn.tolist(), bpe))
        for start, end in _runs(seq.kinds == SegmentKind.TOOL_OUTPUT):
            text = bpe.decode(seq.tokens[start:end])
            assert text.startswith("\n") and text.endswith("\n")  # the generic format's output

    refused = _run(
        "launch.rl",
        *common,
        "--config.data.tokenizer=byte",
        f"--config.rl.warm_start={warm}",
        f"--config.workdir={tmp_path / 'refused'}",
        *SMALL_RL,
    )
    assert refused.returncode == 2
    assert "data.tokenizer: 'byte' is not the tokenizer rl.warm_start was trained" in refused.stderr
