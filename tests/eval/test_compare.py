"""Run comparison: grouping by seed, final metrics with Student-t intervals, paired held-out
differences (same seed -> same tasks), curves and scatter written, refusal to pair different
held-out tasks. Runs are written here as the entry points write them (config.json,
metrics.jsonl, heldout.json) with random numbers."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from composer_jax.eval import compare


def write_run(folder, config, metrics, heldout=None):
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in metrics)
    if heldout is not None:
        with open(os.path.join(folder, "heldout.json"), "w") as f:
            json.dump(heldout, f)


def config(lr, seed, workdir):
    return {
        "optim": {"learning_rate": lr, "b1": 0.9},
        "train": {"phases": [{"name": "main", "seq_len": 64}]},
        "mesh": {"ep": ["fsdp", "cp"]},
        "rl": {"heldout": {"num_tasks": 6, "split": "train"}},
        "data": {"tasks": "builtin"},
        "seed": seed,
        "workdir": workdir,
    }


@pytest.fixture
def sweep(tmp_path):
    """2 learning rates x 3 seeds of RL-like runs with random curves and held-out rewards."""
    rng = np.random.default_rng(7)
    truth = {}
    for lr in (0.001, 0.003):
        for seed in range(3):
            folder = str(tmp_path / f"lr={lr},seed={seed}")
            loss = rng.normal(2.0, 0.3, size=5)
            before = rng.uniform(0, 1, size=6)
            after = np.clip(before + rng.normal(0.1, 0.1, size=6), 0, 1)
            metrics = [{"step": s, "loss": float(v)} for s, v in zip(range(0, 10, 2), loss)]
            heldout = {
                "before": {"per_task": before.tolist(), "pass_rate": 0.1},
                "after-4": {"per_task": after.tolist(), "pass_rate": 0.2},
            }
            write_run(folder, config(lr, seed, folder), metrics, heldout)
            truth[(lr, seed)] = (loss[-1], before, after)
    return tmp_path, truth


def test_groups_by_seed_and_reports_t_intervals(sweep):
    root, truth = sweep
    report = compare.compare_runs([str(root)], str(root / "out"), metrics=["loss", "heldout_after"])
    assert [row["label"] for row in report.rows] == ["learning_rate=0.001", "learning_rate=0.003"]
    for row, lr in zip(report.rows, (0.001, 0.003)):
        assert row["seeds"] == [0, 1, 2]
        finals = [truth[(lr, s)][0] for s in range(3)]
        mean, half, n = row["loss"]
        assert n == 3 and mean == pytest.approx(np.mean(finals))
        expected = stats.t.ppf(0.975, 2) * np.std(finals, ddof=1) / np.sqrt(3)
        assert half == pytest.approx(expected)
        afters = [truth[(lr, s)][2].mean() for s in range(3)]
        assert row["heldout_after"][0] == pytest.approx(np.mean(afters))
    assert "learning_rate=0.003 | 0,1,2 |" in report.markdown
    assert report.markdown.startswith("Made by `python -m launch.compare")
    assert os.path.getsize(root / "out" / "curves.png") > 0
    assert (root / "out" / "compare.md").read_text() == report.markdown


def test_ignored_fields_do_not_split_groups(sweep):
    """Runs each warm-started from their own seed's run differ in rl.warm_start only: with the
    field ignored they are one group per learning rate, as the seeds of one setting."""
    root, _ = sweep
    runs = [compare.load_run(p) for p in compare.find_runs([str(root)])]
    for run in runs:
        run.config["rl"]["warm_start"] = f"runs/sft/seed={run.seed}"
    assert len(compare.group_runs(runs)) == 6
    groups = compare.group_runs(runs, ignore=("rl.warm_start",))
    assert [g.label for g in groups] == ["learning_rate=0.001", "learning_rate=0.003"]
    assert [[r.seed for r in g.runs] for g in groups] == [[0, 1, 2], [0, 1, 2]]


def test_paired_differences_pair_tasks_of_the_same_seed(sweep):
    root, truth = sweep
    groups = compare.group_runs([compare.load_run(p) for p in compare.find_runs([str(root)])])
    pair = compare.paired_difference(groups[0], groups[1])
    diffs = np.concatenate([truth[(0.003, s)][2] - truth[(0.001, s)][2] for s in range(3)])
    assert pair["pairs"] == 18 and pair["seeds"] == [0, 1, 2]
    assert pair["mean"] == pytest.approx(diffs.mean())
    assert pair["half_width"] == pytest.approx(
        stats.t.ppf(0.975, 17) * diffs.std(ddof=1) / np.sqrt(18)
    )
    # The pooled interval holds given these runs; over runs it is the seeds' means' interval.
    means = [(truth[(0.003, s)][2] - truth[(0.001, s)][2]).mean() for s in range(3)]
    over_seeds = stats.t.ppf(0.975, 2) * np.std(means, ddof=1) / np.sqrt(3)
    assert pair["seed_half_width"] == pytest.approx(over_seeds)
    table, _ = compare.differences_table(groups)
    assert "over seeds (95% CI)" in table and f"+- {over_seeds:.3f} |" in table
    gain = compare.within_run_gain(groups[1])
    own = np.concatenate([truth[(0.003, s)][2] - truth[(0.003, s)][1] for s in range(3)])
    assert gain["mean"] == pytest.approx(own.mean()) and gain["pairs"] == 18


@pytest.mark.parametrize("baseline", [-1, 2])
def test_a_baseline_that_is_not_a_group_is_refused(sweep, baseline):
    """-1 paired the last group with itself (+0.000 +- 0.000); 2 of two groups was an
    IndexError naming nothing."""
    root, _ = sweep
    groups = compare.group_runs([compare.load_run(p) for p in compare.find_runs([str(root)])])
    assert len(groups) == 2
    with pytest.raises(ValueError, match="--baseline: .* is not a group"):
        compare.differences_table(groups, baseline)


def test_every_heldout_metric_before_and_after_over_seeds(tmp_path):
    """The fig.-5 table: each metric the evaluator recorded, paired by task within each run and
    pooled, with the Student-t interval over the seeds' own mean changes."""
    rng = np.random.default_rng(11)
    changes = {"reward": [], "best_of_8": []}
    for seed in range(3):
        folder = str(tmp_path / f"seed={seed}")
        values = {k: rng.uniform(0, 1, size=(2, 5)) for k in changes}  # [before, after] x tasks
        for name, (before, after) in values.items():
            changes[name].append(after - before)
        records = {
            key: {
                "per_task": values["reward"][i].tolist(),
                "pass_rate": 0.0,
                "metrics": {"best_of_8": values["best_of_8"][i].tolist()},
            }
            for i, key in enumerate(("before", "after-4"))
        }
        records["before"]["metrics"]["turns"] = [2.0] * 5  # recorded before RL only: left out
        write_run(folder, config(0.001, seed, folder), [{"step": 4, "loss": 1.0}], records)
    report = compare.compare_runs([str(tmp_path)])
    group = compare.group_runs([compare.load_run(p) for p in compare.find_runs([str(tmp_path)])])[0]
    text, gains = compare.heldout_gains_table(group)
    assert [g["metric"] for g in gains] == ["reward", "best_of_8"]
    for g in gains:
        per_run = changes[g["metric"]]
        pooled = np.concatenate(per_run)
        assert g["mean"] == pytest.approx(pooled.mean()) and g["pairs"] == 15
        assert g["half_width"] == pytest.approx(
            stats.t.ppf(0.975, 14) * pooled.std(ddof=1) / np.sqrt(15)
        )
        seed_means = [d.mean() for d in per_run]
        assert g["per_seed"] == pytest.approx(seed_means)
        assert g["seed_half_width"] == pytest.approx(
            stats.t.ppf(0.975, 2) * np.std(seed_means, ddof=1) / np.sqrt(3)
        )
    assert "| best_of_8 |" in text and text in report.markdown


def test_different_heldout_tasks_are_not_paired(tmp_path):
    per_task = {
        "before": {"per_task": [0.1, 0.2], "pass_rate": 0},
        "after-1": {"per_task": [0.3, 0.1], "pass_rate": 0},
    }
    for lr, tasks in ((0.001, "builtin"), (0.003, "humaneval")):
        folder = str(tmp_path / f"r{lr}")
        cfg = config(lr, 0, folder)
        cfg["data"]["tasks"] = tasks
        write_run(folder, cfg, [{"step": 1, "loss": 1.0}], per_task)
    groups = compare.group_runs([compare.load_run(p) for p in compare.find_runs([str(tmp_path)])])
    with pytest.raises(ValueError, match="different held-out tasks"):
        compare.paired_difference(groups[0], groups[1])


def test_heldout_records_pair_by_task_id(tmp_path):
    """Two runs whose held-out sets hold the same number of tasks, only some shared and in
    another order (the set leaves out what each run trains on): the change is taken over the
    shared tasks, matched by id, not position by position; within a run, an extended run's
    "after" pairs with its "before" the same way."""
    records = {
        0.001: {"before": {"per_task": [0.1, 0.2, 0.3], "task_ids": ["a", "b", "c"]}},
        0.003: {
            "before": {"per_task": [0.9, 0.5, 0.7], "task_ids": ["c", "b", "d"]},
            "after-2": {"per_task": [0.4, 0.8, 0.6, 0.0], "task_ids": ["d", "b", "e", "c"]},
        },
    }
    for lr, heldout in records.items():
        folder = str(tmp_path / f"r{lr}")
        write_run(folder, config(lr, 0, folder), [{"step": 1, "loss": 1.0}], heldout)
    runs = [compare.load_run(p) for p in compare.find_runs([str(tmp_path)])]
    groups = sorted(
        compare.group_runs(runs), key=lambda g: g.runs[0].config["optim"]["learning_rate"]
    )
    result = compare.paired_difference(groups[0], groups[1], "before")
    assert result["pairs"] == 2  # b and c
    assert result["mean"] == pytest.approx(((0.5 - 0.2) + (0.9 - 0.3)) / 2)
    gain = compare.within_run_gain(groups[1])
    assert gain["pairs"] == 3  # c, b, d: e has no "before"
    assert gain["mean"] == pytest.approx(((0.0 - 0.9) + (0.8 - 0.5) + (0.4 - 0.7)) / 3)


def test_a_run_without_the_record_is_skipped_before_its_settings_are_compared(tmp_path):
    """The other group's run has no held-out record after RL (it stopped early) and another
    held-out set: nothing to pair, so no refusal either."""
    for lr, tasks, heldout in (
        (
            0.001,
            "builtin",
            {
                "before": {"per_task": [0.1], "task_ids": ["a"]},
                "after-1": {"per_task": [0.2], "task_ids": ["a"]},
            },
        ),
        (0.003, "humaneval", {"before": {"per_task": [0.3], "task_ids": ["a"]}}),
    ):
        folder = str(tmp_path / f"r{lr}")
        cfg = config(lr, 0, folder)
        cfg["data"]["tasks"] = tasks
        write_run(folder, cfg, [{"step": 1, "loss": 1.0}], heldout)
    runs = [compare.load_run(p) for p in compare.find_runs([str(tmp_path)])]
    groups = sorted(
        compare.group_runs(runs), key=lambda g: g.runs[0].config["optim"]["learning_rate"]
    )
    assert compare.paired_difference(groups[0], groups[1], "after") is None
    with pytest.raises(ValueError, match="different held-out tasks"):
        compare.paired_difference(groups[0], groups[1], "before")


def _rl_run(tmp_path, name, seed, rl, lr=0.001):
    folder = str(tmp_path / name)
    cfg = {**config(lr, seed, folder), "rl": rl}
    write_run(folder, cfg, [{"step": 1, "loss": 1.0}], {"before": {"per_task": [0.1, 0.2]}})
    return compare.load_run(folder)


def test_runs_from_before_rl_had_sections_group_and_pair_with_newer_runs(tmp_path):
    """An older run's config.json has flat rl fields (rl.heldout_num_tasks): the same setting as
    a newer run's rl.heldout.num_tasks, for grouping, --ignore and held-out pairing alike."""
    flat = {"heldout_num_tasks": 6, "heldout_split": "train", "kl_coef": 0.01}
    sections = {"heldout": {"num_tasks": 6, "split": "train"}, "objective": {"kl_coef": 0.01}}
    old = _rl_run(tmp_path, "old", 0, flat)
    new = _rl_run(tmp_path, "new", 1, sections)
    (group,) = compare.group_runs([old, new])
    assert group.runs == [old, new]
    other = _rl_run(tmp_path, "other", 0, sections, lr=0.003)
    assert compare.paired_difference(
        compare.Group("old", [old]), compare.Group("new", [other]), "before"
    )
    fewer = _rl_run(tmp_path, "fewer", 0, {**flat, "heldout_num_tasks": 7})
    with pytest.raises(ValueError, match="different held-out tasks"):
        compare.paired_difference(
            compare.Group("new", [other]), compare.Group("7", [fewer]), "before"
        )
    (ignored,) = compare.group_runs([old, new, fewer], ignore=("rl.heldout_num_tasks",))
    assert len(ignored.runs) == 3


def test_sub_run_metrics_and_scatter(sweep):
    root, _ = sweep
    rng = np.random.default_rng(3)
    sub_loss = {}
    for folder in compare.find_runs([str(root)]):
        os.makedirs(os.path.join(folder, "warm_start"))
        sub_loss[folder] = float(rng.uniform(1, 2))
        with open(os.path.join(folder, "warm_start", "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 3, "loss": sub_loss[folder]}) + "\n")
    report = compare.compare_runs(
        [str(root)], str(root / "out"), scatter=("warm_start/loss", "heldout_after")
    )
    assert os.path.getsize(root / "out" / "scatter.png") > 0
    assert "Pearson r" in report.markdown
    run = compare.load_run(compare.find_runs([str(root)])[0])
    assert compare.final_metric(run, "warm_start/loss") == sub_loss[run.workdir]


def test_find_runs_names_a_folder_without_runs(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a run"):
        compare.find_runs([str(tmp_path)])


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMAND = [sys.executable, "-m", "launch.compare"]


def test_command_line_writes_the_report_and_names_bad_folders(sweep, tmp_path):
    root, _ = sweep
    env = dict(os.environ, PYTHONPATH=REPO)
    command = COMMAND
    out = tmp_path / "cmp"
    ok = subprocess.run(
        [*command, str(root), f"--out={out}", "--metrics=loss"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "| learning_rate=0.001 | 0,1,2 |" in ok.stdout
    assert (out / "compare.md").read_text() in ok.stdout and (out / "curves.png").exists()
    bad = subprocess.run(
        [*command, str(tmp_path / "none")], env=env, capture_output=True, text=True
    )
    assert (
        bad.returncode == 2 and bad.stderr.startswith("error: ") and "no such folder" in bad.stderr
    )


def _evaluation_report(tasks, values):
    """A `launch.evaluate` report's per-task part: metric name -> one value per task."""
    return {
        "per_task": {
            task: {"group": "", "samples": 8, **{k: float(v[i]) for k, v in values.items()}}
            for i, task in enumerate(tasks)
        }
    }


def test_evaluation_reports_are_paired_by_task_id_and_pooled_over_pairs(fresh_rng, tmp_path):
    metrics = ("mean_reward", "pass@1", "mean_turns")
    changes, befores, paths = {m: [] for m in metrics}, {m: [] for m in metrics}, []
    for seed in range(2):
        tasks = [f"s{seed}-t{i}" for i in range(6)]
        before = {m: fresh_rng.uniform(0, 1, 6) for m in metrics}
        after = {m: fresh_rng.uniform(0, 1, 6) for m in metrics}
        order = fresh_rng.permutation(6)  # the after report lists the tasks in another order
        pair = (
            _evaluation_report(tasks, before),
            _evaluation_report([tasks[i] for i in order], {m: v[order] for m, v in after.items()}),
        )
        for m in metrics:
            changes[m].append(after[m] - before[m])
            befores[m].append(before[m])
        for which, report in zip(("before", "after"), pair):
            paths.append(tmp_path / f"{seed}-{which}.json")
            paths[-1].write_text(json.dumps(report))
    reports = [json.loads(p.read_text()) for p in paths]
    text, gains = compare.evaluation_gains_table(list(zip(reports[::2], reports[1::2])))
    assert [g["metric"] for g in gains] == ["mean_reward", "pass@1", "mean_turns"]
    for g in gains:
        pooled = np.concatenate(changes[g["metric"]])
        assert g["mean"] == pytest.approx(pooled.mean()) and g["pairs"] == 12
        assert g["half_width"] == pytest.approx(
            stats.t.ppf(0.975, 11) * pooled.std(ddof=1) / np.sqrt(12)
        )
        assert g["before"] == pytest.approx(np.concatenate(befores[g["metric"]]).mean())
        assert g["per_seed"] == pytest.approx([d.mean() for d in changes[g["metric"]]])
    env = dict(os.environ, PYTHONPATH=REPO)
    ok = subprocess.run(
        [*COMMAND, "--reports", *map(str, paths), f"--out={tmp_path / 'cmp'}"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert text in ok.stdout and text in (tmp_path / "cmp" / "compare.md").read_text()
    odd = subprocess.run(
        [*COMMAND, "--reports", *map(str, paths[:3])], env=env, capture_output=True, text=True
    )
    assert odd.returncode == 2 and "in (before, after) pairs, got 3" in odd.stderr
    for bad in ({"per_task": {}}, {"per_task": {"t0": 0.5}}):  # were TypeError tracebacks
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        refused = subprocess.run(
            [*COMMAND, "--reports", str(tmp_path / "bad.json"), str(paths[1])],
            env=env,
            capture_output=True,
            text=True,
        )
        assert refused.returncode == 2 and "not a launch.evaluate report" in refused.stderr
        assert refused.stderr.count("\n") == 1


def test_evaluation_reports_of_different_tasks_are_not_paired():
    before = _evaluation_report(["a", "b"], {"pass@1": [0.1, 0.2]})
    after = _evaluation_report(["a", "c"], {"pass@1": [0.3, 0.1]})
    with pytest.raises(ValueError, match="different tasks"):
        compare.evaluation_gains_table([(before, after)])


def test_a_constant_variable_has_no_correlation():
    """Runs sharing one warm start have equal floats on the x axis: their std is 1e-17, not 0,
    and the report printed r = 0 with an interval (and r = -0.67 one float step apart)."""
    x = [0.1 + 0.2] * 3 + [0.3] * 2  # 0.30000000000000004 and 0.3
    assert compare.correlation([0.1] * 7, list(range(7))) == {"n": 7}
    assert compare.correlation([0.3] * 5, [1.0, 2.0, 3.0, 4.0, 5.0]) == {"n": 5}
    assert "pearson" in compare.correlation(x, [1.0, 2.0, 3.0, 4.0, 5.0])  # they do differ
