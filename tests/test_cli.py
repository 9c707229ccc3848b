"""The entry points from any folder: presets by name, and one-line errors for bad command lines
(unknown fields, positional arguments, bad values, a workdir that is a file, a missing warm
start) with nothing left behind."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(module, *args, cwd):
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", XLA_FLAGS="")  # one device
    return subprocess.run(
        [sys.executable, "-m", f"launch.{module}", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def one_line_error(result, *needles):
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


def test_presets_by_name_and_config_files_work_from_any_folder(tmp_path):
    by_name = launch("accounting", "--config=tiny", cwd=tmp_path)
    assert by_name.returncode == 0, by_name.stderr[-2000:]
    config_file = os.path.join(REPO, "experiments", "configs", "tiny.py")
    by_file = launch("accounting", f"--config={config_file}", cwd=tmp_path)
    assert by_file.returncode == 0, by_file.stderr[-2000:]
    assert by_name.stdout == by_file.stdout and "total" in by_name.stdout


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--config.model.bogus=1"], ["--config.model.bogus", "no such field"]),
        (["--config.steps=abc"], ["--config.steps"]),
        (["--config=no_such_preset"], ["neither a preset"]),
        (["extra"], ["positional", "extra"]),
    ],
)
def test_bad_command_lines_are_one_line_errors(tmp_path, args, needles):
    one_line_error(launch("pretrain", *args, cwd=tmp_path), *needles)


def test_a_workdir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "run").write_text("x")
    one_line_error(
        launch("pretrain", f"--config.workdir={tmp_path / 'run'}", cwd=tmp_path),
        "workdir",
        "not a folder",
    )


def test_a_missing_warm_start_leaves_no_workdir(tmp_path):
    workdir = tmp_path / "rl_run"
    result = launch(
        "rl",
        f"--config.rl.warm_start={tmp_path / 'missing'}",
        f"--config.workdir={workdir}",
        cwd=tmp_path,
    )
    one_line_error(result, "rl.warm_start", "missing")
    assert not workdir.exists()
