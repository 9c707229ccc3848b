"""The entry points from any folder: presets by name, and one-line errors for bad command lines
(unknown fields, positional arguments, bad values, a workdir that is a file, a missing warm
start) with nothing left behind."""

import json
import os
import re
import subprocess
import sys

import pytest

from composer_jax import presets

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


def test_accounting_prices_the_train_state_by_the_optimizer(tmp_path):
    """kimi_k2's MuonClip keeps one float32 moment per Muon matrix and two per AdamW parameter
    (embeddings, head and norms: 2.35B of 1,026B); AdamW everywhere keeps two per parameter."""
    muon, adamw = 1_024_058_392_576, 2_349_816_832
    tib = lambda n: f"{n / 2**40:.2f} TiB"  # noqa: E731
    weights = tib(4 * (muon + adamw))
    done = launch("accounting", "--config=kimi_k2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"weights {weights}, muon state {tib(4 * muon + 8 * adamw)}" in done.stdout
    done = launch("accounting", "--config=kimi_k2", "--config.optim.name=adamw", cwd=tmp_path)
    assert f"weights {weights}, adamw state {tib(8 * (muon + adamw))}" in done.stdout


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--config.model.bogus=1"], ["--config.model.bogus", "no such field"]),
        (["--config.steps=abc"], ["--config.steps"]),
        (["--config=no_such_preset"], ["neither a preset"]),
        (["extra"], ["positional", "extra"]),
        (["--config.stepz=1"], ['--config.stepz: no such field; did you mean "steps"?']),
        # The override named is the bad one, not a good one whose name contains it.
        (
            ["--config.model.num_layers=4", "--config.model.num_layer=3"],
            ["override: --config.model.num_layer: no such field"],
        ),
    ],
)
def test_bad_command_lines_are_one_line_errors(tmp_path, args, needles):
    line = one_line_error(launch("pretrain", *args, cwd=tmp_path), *needles)
    assert "\\" not in line  # printed as text, not as a repr


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


@pytest.mark.parametrize("entry", ["pretrain", "rl"])
def test_a_misspelled_tracker_stops_the_run_before_its_workdir_exists(entry, tmp_path):
    workdir = tmp_path / "run"
    result = launch(
        entry, "--config.log.trackers=tensorbaord", f"--config.workdir={workdir}", cwd=tmp_path
    )
    one_line_error(result, "log.trackers", "unknown tracker 'tensorbaord'")
    assert not workdir.exists()


@pytest.mark.parametrize(
    ("entry", "override", "field"),
    [
        ("pretrain", "--config.data.corpus_root=/nonexistent", "data.corpus_root"),
        ("pretrain", "--config.data.tasks=nosuch", "data.tasks"),  # its SFT phase comes last
        ("rl", "--config.data.tasks=jsonl:/nonexistent", "data.tasks"),
        ("rl", "--config.rl.heldout.tasks=nosuch", "rl.heldout.tasks"),
    ],
)
def test_a_data_source_that_cannot_be_read_stops_the_run_before_its_workdir(
    entry, override, field, tmp_path
):
    workdir = tmp_path / "run"
    result = launch(entry, override, f"--config.workdir={workdir}", cwd=tmp_path)
    one_line_error(result, f"error: {field}: ")
    assert not workdir.exists()


# ----------------------------------------------------------------------------- typed overrides


def resolved(*args, cwd):
    """The config `--print_config` prints for these flags."""
    result = launch("pretrain", "--print_config", *args, cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_print_config_applies_tuple_none_and_indexed_overrides(tmp_path):
    cfg = resolved(
        "--config.mesh.ep=fsdp",
        "--config.model.q_lora_rank=None",
        "--config.model.rope_scaling.factor=8",
        "--config.train.phases[1].seq_len",
        "64",
        "--config.steps=7",
        cwd=tmp_path,
    )
    assert cfg["mesh"]["ep"] == ["fsdp"]
    assert cfg["model"]["q_lora_rank"] is None
    assert cfg["model"]["rope_scaling"]["factor"] == 8.0
    assert cfg["model"]["rope_scaling"]["beta_fast"] == 32.0  # the rest from the defaults
    assert [p["seq_len"] for p in cfg["train"]["phases"]] == [128, 64, 576]
    assert cfg["steps"] == 7


def test_printed_config_loads_back_as_json_and_variants_select_presets(tmp_path):
    printed = resolved("--config.steps=11", "--config.mesh.ep=", cwd=tmp_path)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(printed))
    assert resolved(f"--config={path}", cwd=tmp_path) == printed
    preset_file = os.path.join(REPO, "launch", "preset_config.py")
    by_variant = resolved(f"--config={preset_file}:rl_tiny", cwd=tmp_path)
    assert by_variant == resolved("--config=rl_tiny", cwd=tmp_path)
    assert by_variant["steps"] == presets.rl_tiny().steps != printed["steps"]


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--config.model.num_layers=None"], ["--config.model.num_layers", "cannot be None"]),
        (["--config.model.q_lora_rank=abc"], ["q_lora_rank", "not an integer"]),
        (["--config.train.phases[5].seq_len=3"], ["phases[5]", "out of range"]),
        (["--config.train.phases=[{'name': 'x', 'bogus': 1}]"], ["bogus", "unknown field"]),
        ([f"--config={os.path.join(REPO, 'experiments', 'configs', 'tiny.py')}:v"], ["get_config"]),
    ],
)
def test_bad_typed_overrides_are_one_line_errors(tmp_path, args, needles):
    one_line_error(launch("pretrain", "--print_config", *args, cwd=tmp_path), *needles)


def test_typed_override_parsing_in_process():
    from launch import cli

    argv = ["--config.steps=3", "--config.mesh.ep", "cp", "--config.data.extensions=.py,.pyi"]
    rest, typed = cli._split_typed_overrides(argv)
    assert rest == ["--config.steps=3"]
    assert typed == [("mesh.ep", "cp"), ("data.extensions", ".py,.pyi")]
    data = {"mesh": {"ep": ["fsdp"]}, "data": {"extensions": [".py"]}}
    for path, raw in typed:
        cli._apply_typed_override(data, path, raw)
    assert data == {"mesh": {"ep": ["cp"]}, "data": {"extensions": [".py", ".pyi"]}}
    with pytest.raises(cli.CommandLineError, match="no such field"):
        cli._apply_typed_override(data, "mesh.bogus", "1")


ENTRY_POINTS = sorted(
    name[: -len(".py")]
    for name in os.listdir(os.path.join(REPO, "launch"))
    if name.endswith(".py")
    and 'if __name__ == "__main__"' in open(os.path.join(REPO, "launch", name)).read()
)


def expected_flags(module: str) -> set[str]:
    """The flags an entry point defines in its own source, plus those of the helpers it calls."""
    source = open(os.path.join(REPO, "launch", f"{module}.py")).read()
    names = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", source))
    if "cli.define_config(" in source:
        names |= {"config", "print_config"}
    if "cli.define_run_folder(" in source:
        names |= {"config.workdir"}
    if "plain_log.define_flags()" in source:
        names |= {"progress", "log_every_s", "log_every_steps"}
    return names


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_lists_the_entry_points_own_flags(tmp_path, module):
    result = launch(module, "--help", cwd=tmp_path)
    assert result.returncode == 1 and not result.stderr, result.stderr[-2000:]  # absl's --help
    listed = set(re.findall(r"^  --(?:\[no\])?([\w.]+)", result.stdout, re.MULTILINE))
    wanted = expected_flags(module)
    assert wanted and wanted <= listed, wanted - listed
    if "config" in wanted:  # the config's sections, one line each
        assert "The config (" in result.stdout and "  rl " in result.stdout
        assert "--print_config" in result.stdout


def test_a_run_folder_is_config_workdir_and_the_old_spelling_warns(tmp_path):
    new = launch("export", f"--config.workdir={tmp_path / 'none'}", "--out=x", cwd=tmp_path)
    old = launch("export", f"--workdir={tmp_path / 'none'}", "--out=x", cwd=tmp_path)
    assert new.returncode == old.returncode == 2
    assert "--config.workdir" not in new.stderr and "warning: --workdir is now" in old.stderr
    one_line_error(launch("export", "--out=x", cwd=tmp_path), "--config.workdir", "required")


def test_an_old_flat_rl_override_warns_once_and_lands_in_its_section(tmp_path):
    """rl's fields moved into sections (objective, rollout, agent, heldout); the old flat paths
    still work for one release, each with one warning line naming its new path (printed once,
    though the entry point executes itself again for its malloc settings)."""
    result = launch(
        "rl",
        "--print_config",
        "--config.rl.kl_coef=0.01",
        "--config.rl.heldout_num_tasks",
        "5",
        "--config.rl.prefill_buckets=64,128",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        "warning: --config.rl.kl_coef is now --config.rl.objective.kl_coef",
        "warning: --config.rl.heldout_num_tasks is now --config.rl.heldout.num_tasks",
        "warning: --config.rl.prefill_buckets is now --config.rl.rollout.prefill_buckets",
    ]
    rl = json.loads(result.stdout)["rl"]
    assert rl["objective"]["kl_coef"] == 0.01
    assert rl["heldout"]["num_tasks"] == 5
    assert rl["rollout"]["prefill_buckets"] == [64, 128]
    assert "kl_coef" not in rl and "heldout_num_tasks" not in rl


def test_print_config_refuses_what_a_run_would_refuse(tmp_path):
    result = launch(
        "rl",
        "--config=rl_tiny",
        "--config.model.num_experts_per_tok=99",
        "--print_config",
        cwd=tmp_path,
    )
    one_line_error(result, "num_experts_per_tok")
    assert not os.listdir(tmp_path)


BAD_INPUTS = {
    "unknown field": (["--config.model.bogus=1"], "no such field"),
    "typo": (["--config.stepz=1"], "did you mean"),
    "wrong type": (["--config.steps=abc"], "--config.steps"),
    "unsupported bucket": (["--config.workdir=s3://bucket/run"], "workdir: 's3://"),
    "workdir is a file": (
        ["--config.workdir={file}"],
        "workdir: {file} exists and is not a folder",
    ),
}
RUN_INPUTS = {  # the entry points that read a run
    "unsupported bucket": (["--config.workdir=s3://bucket/run"], "s3://"),
    "no such run": (["--config.workdir={missing}"], "{missing}"),
    "workdir is a file": (["--config.workdir={file}"], "{file}"),
    "unknown flag": (["--config.bogus=1"], "bogus"),
}
RL_INPUTS = {  # paths only the RL run takes
    "trace under a file": (["--config.rl.trace={file}/trace.json"], "rl.trace"),
    "trace is a folder": (["--config.rl.trace={folder}"], "rl.trace"),
}
CASES = [
    (module, name, args, needle, progress)
    for module, table in (("pretrain", BAD_INPUTS), ("rl", BAD_INPUTS), ("evaluate", RUN_INPUTS))
    for name, (args, needle) in table.items()
    for progress in ("--progress", "--noprogress")
]
CASES += [
    ("export", name, [*args, "--out=out"], needle, None)
    for name, (args, needle) in RUN_INPUTS.items()
]
CASES += [  # a bucket target the machine cannot write: refused before anything is read
    (
        "export",
        "unwritable bucket",
        ["--config.workdir={missing}", "--out=gs://b/x"],
        "--out: ",
        None,
    ),
    ("export", "unknown scheme", ["--config.workdir={missing}", "--out=s3://b/x"], "--out: ", None),
    # An older export's index beside a new single file would load in its place.
    (
        "export",
        "out holds files",
        ["--config.workdir={missing}", "--out={occupied}"],
        "--out: {occupied} holds files",
        None,
    ),
    ("export", "out is a file", ["--config.workdir={missing}", "--out={file}"], "is a file", None),
    # Refused at parsing, before a model loads: the scored text and the sampling settings.
    ("eval", "no stride", ["--config.workdir={missing}", "--stride=0"], "--stride=0", None),
    (
        "eval",
        "stride over window",
        ["--config.workdir={missing}", "--window=8", "--stride=16"],
        "--stride must be at most --window",
        None,
    ),
    (
        "eval",
        "no such code",
        ["--config.workdir={missing}", "--eval_dir={missing}/code"],
        "--eval_dir={missing}/code: no such folder",
        None,
    ),
    ("evaluate", "bad ks", ["--config.workdir={missing}", "--ks=1,x"], "--ks=", None),
    ("evaluate", "no samples", ["--config.workdir={missing}", "--samples=0"], "--samples=0", None),
    (  # refused at parsing, before the model loads
        "export",
        "no shard size",
        ["--config.workdir={missing}", "--out=out", "--shard_size_mb=0"],
        "--shard_size_mb=0",
        None,
    ),
]
CASES += [
    ("rl", name, [*args, "--config.workdir={missing}"], needle, "--noprogress")
    for name, (args, needle) in RL_INPUTS.items()
]


@pytest.mark.parametrize(
    "module,name,args,needle,progress", CASES, ids=[f"{c[0]}-{c[1]}-{c[4]}" for c in CASES]
)
def test_bad_inputs_are_one_line_errors_that_write_nothing(
    tmp_path, module, name, args, needle, progress
):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "an_export").mkdir()
    (tmp_path / "an_export" / "model.safetensors.index.json").write_text("{}")
    names = {
        "file": str(tmp_path / "a_file"),
        "missing": str(tmp_path / "missing"),
        "folder": str(tmp_path / "a_folder"),
        "occupied": str(tmp_path / "an_export"),
    }
    args = [a.format(**names) for a in args] + ([progress] if progress else [])
    before = sorted(p.name for p in tmp_path.iterdir())
    result = launch(module, *args, cwd=tmp_path)
    one_line_error(result, needle.format(**names))
    assert "Traceback" not in result.stdout + result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert [p.name for p in (tmp_path / "an_export").iterdir()] == ["model.safetensors.index.json"]


def test_a_run_that_fails_once_started_exits_1_in_one_line(tmp_path):
    result = launch(
        "pretrain",
        "--config=tiny",
        "--config.steps=3",
        "--config.optim.learning_rate=1e30",  # the parameters blow up at the first update
        "--config.optim.warmup_steps=0",
        f"--config.workdir={tmp_path / 'run'}",
        "--noprogress",
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "non-finite loss" in errors[0]
    assert "no checkpoint was saved before it" in errors[0]
    assert "Traceback" not in result.stderr
