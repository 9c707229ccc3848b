"""The main job's closing lines: the held-out change with a Student-t interval paired by task and
a plain verdict, and the warm start's numbers with why its corpus NLL rises."""

import dataclasses
import json

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from composer_jax import presets
from composer_jax.actor.evaluator import HeldoutResult, t_half_width
from composer_jax.actor.report import (
    _plot_advantage_parts,
    closing_summary,
    heldout_once,
    plot_curves,
)
from composer_jax.train.loop import nll_summary

# Two-sided 97.5% quantiles of Student's t (tables), n - 1 = 3 and 31 degrees of freedom.
T_975 = {3: 3.182446, 31: 2.039513}


def test_half_width_is_student_t():
    rng = np.random.default_rng(0)
    for n in (4, 32):
        values = rng.normal(size=n)
        want = T_975[n - 1] * values.std(ddof=1) / np.sqrt(n)
        assert t_half_width(values) == pytest.approx(want, rel=1e-5)
    assert np.isnan(t_half_width(np.array([1.0])))


def _run(tmp_path, losses, nlls):
    cfg = dataclasses.replace(presets.rl_tiny(), workdir=str(tmp_path))
    (tmp_path / "warm_start").mkdir()
    records = [{"step": i + 1, "loss": v} for i, v in enumerate(losses)]
    records += [{"step": 0, "eval_nll": nlls[0]}, {"step": len(losses), "eval_nll": nlls[1]}]
    (tmp_path / "warm_start" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records)
    )
    return cfg


@pytest.mark.parametrize(
    "shift, verdict", [(0.3, "RL raised it"), (-0.3, "RL lowered it"), (0.0, "noise")]
)
def test_closing_summary_says_what_changed(tmp_path, shift, verdict):
    cfg = _run(tmp_path, [0.9, 0.5, 0.04], [6.03, 7.98])
    rng = np.random.default_rng(1)
    before = rng.uniform(0, 0.5, size=32)
    after = before + shift + (rng.normal(scale=0.05, size=32) if shift else 0.0)
    text = closing_summary(cfg, HeldoutResult(before, 0.1), HeldoutResult(after, 0.2), 24)
    diff = after - before
    half = T_975[31] * diff.std(ddof=1) / np.sqrt(32) if shift else 0.0
    assert f"{diff.mean():+.3f} (95% CI {diff.mean() - half:+.3f} to {diff.mean() + half:+.3f}" in (
        text
    )
    assert verdict in text and "paired over 32 tasks" in text and "24 steps" in text
    assert "training loss 0.900 -> 0.040" in text
    assert "code-corpus NLL 6.03 -> 7.98" in text and "it rises: SFT fits task solutions" in text


def test_nll_line_explains_a_rise_only_when_the_corpus_was_not_trained():
    sft = presets.rl_tiny()
    assert "it rises because" in nll_summary(sft, 6.0, 8.0)
    assert "it rises" not in nll_summary(sft, 8.0, 6.0)
    pretrain = presets.tiny()  # has corpus phases
    assert any(p.data == "corpus" for p in pretrain.train.phases)
    assert "it rises" not in nll_summary(pretrain, 6.0, 8.0)


def test_the_curves_draw_one_line_per_reward_parts_advantage(tmp_path):
    rng = np.random.default_rng()
    parts = ["kl", "length_penalty", "task", "total"]
    lines = [
        {
            "step": s,
            "staleness_mean": 0.0,
            "reward_mean": 0.1,
            **{f"advantage_rms/{p}": rng.uniform() for p in parts},
        }
        for s in range(1, 6)
    ]
    # A step without the parts (nor a reward: every sample abandoned): a gap, no error.
    lines.append({"step": 6, "staleness_mean": 0.0})
    _, ax = plt.subplots()
    _plot_advantage_parts(ax, [m["step"] for m in lines], lines)
    drawn = {line.get_label(): line.get_ydata() for line in ax.get_lines()}
    assert sorted(drawn) == parts
    np.testing.assert_allclose(drawn["task"][:5], [m["advantage_rms/task"] for m in lines[:5]])
    assert np.isnan(drawn["task"][5])
    plt.close("all")
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in lines))
    plot_curves(str(path), str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


class _Evaluator:
    def __init__(self, result):
        self.result = result

    def evaluate(self, model):
        return self.result


def test_an_extended_runs_heldout_change_pairs_tasks_by_id(tmp_path):
    """A run extended with more steps leaves out other prompts: its "after" set differs from the
    stored "before". The closing change is over the tasks both hold, matched by id."""
    cfg = _run(tmp_path, [0.9, 0.5], [6.0, 7.0])
    path = tmp_path / "heldout.json"
    before = HeldoutResult(np.array([0.1, 0.2, 0.3]), 0.1, {}, ("a", "b", "c"))
    stored = heldout_once(cfg, _Evaluator(before), None, path, "before", False)
    assert stored.task_ids == ("a", "b", "c")  # written, and read back as written
    again = heldout_once(cfg, _Evaluator(None), None, path, "before", False)
    assert again.task_ids == ("a", "b", "c") and list(again.per_task) == [0.1, 0.2, 0.3]
    after = HeldoutResult(np.array([0.9, 0.6, 0.0]), 0.2, {}, ("c", "b", "d"))
    assert after.improvement_over(again)[0] == pytest.approx(((0.9 - 0.3) + (0.6 - 0.2)) / 2)
    text = closing_summary(cfg, again, after, 30)
    assert "paired over 2 tasks" in text
    elsewhere = HeldoutResult(np.array([0.5]), 0.0, {}, ("z",))
    assert "not compared (the two held-out records share no task" in closing_summary(
        cfg, again, elsewhere, 30
    )
