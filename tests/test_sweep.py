"""Sweeps: the grid (product x zip x seeds), names from the varying values, commands that the
entry points resolve, finished / started / new runs, a failing run reported while the others go
on, and the SLURM array of the unfinished runs. The acceptance run (a real 2 x 2 pretraining grid,
compared, then nothing re-run) is slow."""

import io
import json
import os
import subprocess
import sys

import pytest

from composer_jax import config as config_lib
from composer_jax import presets
from launch import sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spec(**kw):
    return sweep.check_spec({"base": "tiny", **kw})


def test_grid_is_product_times_zip_times_seeds_and_names_the_varying_values():
    s = spec(
        fixed={"steps": 3},
        product={"optim.learning_rate": [1e-3, 3e-3]},
        zip={"optim.b1": [0.8, 0.9], "optim.b2": [0.95, 0.99]},
        seeds=[0, 1],
    )
    varying = sweep.grid(s)
    assert len(varying) == 2 * 2 * 2
    assert varying[0] == {"optim.learning_rate": 1e-3, "optim.b1": 0.8, "optim.b2": 0.95, "seed": 0}
    assert {(v["optim.b1"], v["optim.b2"]) for v in varying} == {(0.8, 0.95), (0.9, 0.99)}
    names = sweep.run_names(varying)
    assert names[0] == "learning_rate=0.001,b1=0.8,b2=0.95,seed=0"
    assert sweep.run_names([{"a.x": 1, "b.x": 2}]) == ["a.x=1,b.x=2"]  # same last part: full path


@pytest.mark.parametrize(
    "bad,needle",
    [
        ({"base": "nope"}, "neither a preset"),
        ({"base": "tiny", "entry": "train"}, "entry"),
        ({"base": "tiny", "zip": {"a": [1], "b": [1, 2]}}, "differ in length"),
        ({"base": "tiny", "fixed": {"seed": 1}, "seeds": [0]}, "seed comes from"),
        ({"base": "tiny", "fixed": {"workdir": "x"}}, "given twice"),
        ({"base": "tiny", "product": {"steps": []}}, "non-empty"),
        ({"base": "tiny", "grid": {}}, "unknown sweep keys"),
    ],
)
def test_bad_sweeps_are_named(bad, needle):
    with pytest.raises(sweep.SweepError, match=needle):
        sweep.check_spec(bad)


def test_a_seed_zipped_with_its_own_value_varies_without_seeds(tmp_path):
    s = spec(zip={"seed": [0, 1], "rl.warm_start": ["w/seed=0", "w/seed=1"]})
    runs = sweep.plan(s, str(tmp_path))
    assert [r.name for r in runs] == ["seed=0,warm_start=w_seed=0", "seed=1,warm_start=w_seed=1"]
    assert "--config.seed=1" in runs[1].command
    assert "--config.rl.warm_start=w/seed=1" in runs[1].command


def test_plan_resolves_each_run_as_its_entry_point_does(tmp_path):
    s = spec(
        fixed={"steps": 5, "mesh.ep": ("fsdp",), "train.phases[0].seq_len": 64},
        product={"optim.learning_rate": [0.002]},
        seeds=[3],
    )
    (run,) = sweep.plan(s, str(tmp_path))
    assert run.name == "learning_rate=0.002,seed=3"
    assert run.workdir == str(tmp_path / run.name)
    cfg = sweep.resolve(run)
    assert cfg["steps"] == 5 and cfg["seed"] == 3 and cfg["workdir"] == run.workdir
    assert cfg["mesh"]["ep"] == ["fsdp"] and cfg["train"]["phases"][0]["seq_len"] == 64
    assert cfg["optim"]["learning_rate"] == 0.002
    bad = sweep.plan(spec(fixed={"model.bogus": 1}), str(tmp_path))[0]
    with pytest.raises(sweep.SweepError, match="bogus"):
        sweep.resolve(bad)


def test_a_dict_base_resolves_before_it_is_written_to_the_root(tmp_path):
    base = config_lib.to_dict(presets.tiny())
    base["steps"] = 9
    s = sweep.check_spec({"base": base})
    (run,) = sweep.prepare(s, str(tmp_path / "root"))
    assert run.steps == 9
    assert not (tmp_path / "root").exists()  # planning (a dry run) writes nothing
    assert sweep.write_base(s, str(tmp_path / "root")) == str(tmp_path / "root" / sweep.BASE_FILE)
    assert sweep.resolve(run)["steps"] == 9  # the runs' own --config


def sweep_main(tmp_path, text, *flags):
    """`launch.sweep` on a sweep file holding `text`: (exit status, stderr)."""
    path = tmp_path / "a_sweep.py"
    path.write_text(text)
    command = [sys.executable, "-m", "launch.sweep", f"--sweep={path}", *flags]
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=tmp_path, env=sweep.subprocess_env()
    )
    return result.returncode, result.stderr


@pytest.mark.parametrize(
    "text,needle",
    [
        ("def get_sweep(:\n", "a_sweep.py:1: SyntaxError"),
        ("def get_sweep():\n    return {'base': 'tiny'}[0]\n", "a_sweep.py:2: KeyError"),
        (
            "def get_sweep():\n    return {'base': 'tiny', 'compare': {'metric': ['loss']}}\n",
            "compare: unknown options ['metric']",
        ),
    ],
    ids=["syntax error", "get_sweep raises", "unknown compare option"],
)
def test_a_broken_sweep_file_is_a_one_line_error_before_anything_is_written(tmp_path, text, needle):
    code, stderr = sweep_main(tmp_path, text, f"--root={tmp_path / 'root'}")
    assert code == 2 and needle in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert not (tmp_path / "root").exists()


def test_a_broken_module_a_sweep_file_imports_is_named_where_the_sweep_imports_it(tmp_path):
    (tmp_path / "helper.py").write_text("\n\n\ndef broken(:\n")
    text = "import sys\nsys.path.insert(0, '.')\nimport helper\n"
    code, stderr = sweep_main(tmp_path, text, f"--root={tmp_path / 'root'}")
    assert code == 2 and "a_sweep.py:3: SyntaxError" in stderr and "helper.py" in stderr, stderr


def test_an_unwritable_root_is_a_one_line_error(tmp_path):
    (tmp_path / "a_file").write_text("x")
    text = (
        "from composer_jax import presets\ndef get_sweep():\n    return {'base': presets.tiny()}\n"
    )
    code, stderr = sweep_main(tmp_path, text, f"--root={tmp_path / 'a_file' / 'root'}")
    assert code == 2 and "cannot write the base config" in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1


def test_a_dry_run_of_a_dict_base_writes_nothing(tmp_path):
    text = (
        "from composer_jax import presets\n"
        "def get_sweep():\n    return {'base': presets.tiny(), 'seeds': [0, 1]}\n"
    )
    code, stderr = sweep_main(tmp_path, text, f"--root={tmp_path / 'root'}", "--dry_run")
    assert code == 0, stderr
    assert not (tmp_path / "root").exists()


def write_metrics(workdir, steps):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps)


def test_status_finished_started_new(tmp_path):
    assert sweep.run_status(str(tmp_path / "a"), 4, "pretrain") == "new"
    write_metrics(tmp_path / "a", [1, 2])
    assert sweep.run_status(str(tmp_path / "a"), 4, "pretrain") == "started"
    write_metrics(tmp_path / "a", [2, 4])
    assert sweep.run_status(str(tmp_path / "a"), 4, "pretrain") == "finished"
    assert sweep.run_status(str(tmp_path / "a"), 4, "rl") == "started"  # no held-out "after"
    (tmp_path / "a" / "heldout.json").write_text(json.dumps({"before": {}, "after-3": {}}))
    assert sweep.run_status(str(tmp_path / "a"), 4, "rl") == "started"
    (tmp_path / "a" / "heldout.json").write_text(json.dumps({"before": {}, "after-4": {}}))
    assert sweep.run_status(str(tmp_path / "a"), 4, "rl") == "finished"


def fake_run(tmp_path, name, code, status="new"):
    """A run whose command is a small Python program (the scheduling does not care)."""
    workdir = str(tmp_path / name)
    command = [sys.executable, "-c", code]
    return sweep.Run(name, {}, command, workdir, str(tmp_path / "logs" / f"{name}.log"), 1, status)


def test_execute_runs_the_unfinished_reports_failures_and_goes_on(tmp_path):
    marker = tmp_path / "ran"
    runs = [
        fake_run(tmp_path, "done", "raise SystemExit(3)", status="finished"),
        fake_run(tmp_path, "bad", "import sys; print('boom: no such thing'); sys.exit(2)"),
        fake_run(tmp_path, "good", f"open({str(marker)!r}, 'w').write('x'); print('fine')"),
        fake_run(tmp_path, "again", "print('resumed')", status="started"),
    ]
    out = io.StringIO()
    results = sweep.execute(runs, parallel=2, out=out)
    assert results == {"bad": 2, "good": 0, "again": 0}
    assert marker.exists()
    text = out.getvalue()
    assert "skip   done (finished" in text and "resume again" in text
    assert "FAILED bad (exit 2" in text and "boom: no such thing" in text
    assert "[3/3]" in text
    log = (tmp_path / "logs" / "good.log").read_text()
    assert log.startswith("\n=== ") and "fine" in log


def test_emit_slurm_lists_only_unfinished_runs(tmp_path):
    s = spec(product={"optim.learning_rate": [1e-3, 3e-3]}, slurm={"time": "01:00:00"})
    runs = sweep.plan(s, str(tmp_path))
    runs[0].status = "finished"
    path = sweep.emit_slurm(s, runs, str(tmp_path), parallel=4)
    text = open(path).read()
    assert "#SBATCH --array=0-0%4" in text and "#SBATCH --time=01:00:00" in text
    assert runs[1].name in text and f"--config.workdir={runs[0].workdir}" not in text
    assert subprocess.run(["bash", "-n", path]).returncode == 0  # valid bash


@pytest.mark.slow
def test_acceptance_grid_then_compare_then_nothing_new(tmp_path):
    """A 2 x 2 grid of tiny pretraining runs (lr x seed), compared; a second sweep runs nothing."""
    sweep_file = os.path.join(REPO, "experiments", "sweeps", "lr_seed_tiny.py")
    command = [sys.executable, "-m", "launch.sweep", f"--sweep={sweep_file}", f"--root={tmp_path}"]
    env = dict(os.environ, PYTHONPATH=REPO, XLA_FLAGS="")
    first = subprocess.run(
        [*command, "--parallel=2", "--compare"], env=env, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert first.stdout.count("done   ") == 4
    assert "| learning_rate=0.001 | 0,1 |" in first.stdout
    assert os.path.getsize(tmp_path / "compare" / "curves.png") > 0
    second = subprocess.run(command, env=env, capture_output=True, text=True)
    assert second.returncode == 0 and second.stdout.count("skip   ") == 4
    assert "0 run now" in second.stdout
