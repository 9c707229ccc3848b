"""A run's folder: checked before anything is written, the config written only once the run is
known to start (so a refused resume leaves the old run's files as they were)."""

import json
import os

from composer_jax import config as config_lib


def prepare_workdir(path: str) -> str:
    """The absolute workdir, created if needed; a ConfigError naming `workdir` when it is a file,
    cannot be created, or is not writable."""
    workdir = os.path.abspath(path)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise config_lib.ConfigError(f"workdir: {workdir} exists and is not a folder")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as error:
        raise config_lib.ConfigError(
            f"workdir: cannot create {workdir} ({error.strerror})"
        ) from None
    probe = os.path.join(workdir, f".write_probe_{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        raise config_lib.ConfigError(
            f"workdir: {workdir} is not writable ({error.strerror})"
        ) from None
    return workdir


def write_config(workdir: str, cfg: config_lib.ExperimentConfig) -> None:
    """`config.json`, replaced atomically (a crash never leaves half a config)."""
    path = os.path.join(workdir, "config.json")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(config_lib.to_dict(cfg), f, indent=2)
    os.replace(tmp, path)


def read_run_config(workdir: str) -> config_lib.ExperimentConfig:
    """A run's stored config, with the fields of older versions carried to their new names."""
    check_run_folder(workdir, "workdir")
    with open(os.path.join(workdir, "config.json")) as f:
        data = json.load(f)
    return config_lib.from_dict(config_lib.ExperimentConfig, upgrade_stored_config(data))


def upgrade_stored_config(data: dict) -> dict:
    """Renamed fields of older configs: data.task_max_ops became data.tasks, the phase data
    "builtin_tasks" became "tasks", rl.heldout_tasks (a count) became rl.heldout_num_tasks and
    the held-out splits "functions" / "instances" became "held_out" / "train"."""
    data = json.loads(json.dumps(data))  # a deep copy
    section = data.get("data", {})
    if "task_max_ops" in section:
        section["tasks"] = f"builtin:max_ops={section.pop('task_max_ops')}"
    for phase in data.get("train", {}).get("phases", []):
        if phase.get("data") == "builtin_tasks":
            phase["data"] = "tasks"
    rl = data.get("rl", {})
    if isinstance(rl.get("heldout_tasks"), int):
        rl["heldout_num_tasks"] = rl.pop("heldout_tasks")
    renamed = {"functions": "held_out", "instances": "train"}
    if rl.get("heldout_split") in renamed:
        rl["heldout_split"] = renamed[rl["heldout_split"]]
    return data


def check_run_folder(path: str, what: str) -> str:
    """A finished run's folder (with its config.json), or a ConfigError naming the field `what`."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise config_lib.ConfigError(f"{what}: {path!r} is not a run folder (no config.json there)")
    return path
