"""The rules of a run's folder, which `train.run_folder.RunFolder` applies in order: checked
before anything is written, the config written only once the run is known to start (so a refused
resume leaves the old run's files as they were).

Runs cannot be mixed up: starting on a workdir that holds a run resumes it only when the stored
config equals the new one (`check_resume`; `resume` chooses auto / never / must), and every start
appends what made it to `launches.jsonl` (command line, git commit and dirtiness, package
versions, devices, the full config; `record_launch`).

Every path here goes through `etils.epath`, so a workdir may be local or a bucket (`gs://`,
given gcsfs and google-cloud-storage); `run_path` keeps a URI a URI (`os.path.abspath("gs://b")`
would make a local folder named `gs:`)."""

import dataclasses
import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys

from etils import epath

from composer_jax import config as config_lib

LAUNCHES = "launches.jsonl"
# Fields that say where and how verbosely a run goes, not what it computes: free to differ.
_FREE_ON_RESUME = (
    "resume",
    "workdir",
    "print_sharding",
    "rl.trace",
    *(f"log.{field.name}" for field in dataclasses.fields(config_lib.LogConfig)),
)
# URI schemes a run folder may have, with the client orbax needs besides epath's fsspec one (it
# asks google-cloud-storage for a bucket's layout). epath serves s3:// too, but orbax 0.12 writes
# checkpoint tensors only to local paths and gs:// (tensorstore's gcs driver).
_SCHEMES = {"gs": "google.cloud.storage"}
_RECORDED_PACKAGES = (
    "composer-jax",
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "numpy",
    "ml-collections",
    "tokenizers",
    "tiktoken",
    "ray",
)


def run_path(path: str, field: str) -> epath.Path:
    """`path` as an epath: a local path made absolute, a URI kept as one; a ConfigError naming
    `field` for a scheme epath does not know or whose client cannot be loaded."""
    scheme, sep, _ = str(path).partition("://")
    if not sep:
        return epath.Path(os.path.abspath(path))
    if scheme not in _SCHEMES:
        raise config_lib.ConfigError(
            f"{field}: {path!r} has the scheme {scheme}://; a folder here is a local path or "
            f"{', '.join(s + '://' for s in _SCHEMES)} (where orbax can write checkpoints)"
        )
    remote = epath.Path(path)
    try:
        remote.exists()  # loads the scheme's fsspec client and asks the store once
        importlib.import_module(_SCHEMES[scheme])
    except ImportError as error:
        raise config_lib.ConfigError(
            f"{field}: {path} needs the gcs extra (pip install -e .[gcs]): {first_line(error)}"
        ) from None
    except Exception as error:  # the client's own: credentials, a missing bucket, the network
        raise config_lib.ConfigError(
            f"{field}: cannot reach {path} ({type(error).__name__}: {first_line(error)})"
        ) from None
    return remote


def is_remote(path) -> bool:
    """Whether `path` is a URI (a bucket), not a local path."""
    return bool(str(path).partition("://")[1])


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def prepare_workdir(path: str, field: str = "workdir") -> str:
    """The absolute workdir (or its URI), created if needed; a ConfigError naming `field` when
    it is a file, cannot be created, or is not writable."""
    workdir = run_path(path, field)
    if workdir.exists() and not workdir.is_dir():
        raise config_lib.ConfigError(f"{field}: {workdir} exists and is not a folder")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise config_lib.ConfigError(
            f"{field}: cannot create {workdir} ({error.strerror or first_line(error)})"
        ) from None
    probe = workdir / f".write_probe_{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise config_lib.ConfigError(
            f"{field}: {workdir} is not writable ({error.strerror or first_line(error)})"
        ) from None
    return str(workdir)


def write_config(workdir: str, cfg: config_lib.ExperimentConfig) -> None:
    """`config.json`, replaced atomically (a crash never leaves half a config; on a bucket an
    object is written whole anyway)."""
    path = epath.Path(workdir) / "config.json"
    tmp = path.parent / f"{path.name}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(config_lib.to_dict(cfg), indent=2))
    tmp.replace(path)


def holds_run(workdir: str) -> bool:
    """Whether a run was started in `workdir` (its config or a checkpoint is there)."""
    checkpoints = epath.Path(workdir) / "checkpoints"
    return (epath.Path(workdir) / "config.json").is_file() or (
        checkpoints.is_dir() and any(checkpoints.iterdir())
    )


def config_diff(
    stored: config_lib.ExperimentConfig, new: config_lib.ExperimentConfig
) -> list[tuple[str, object, object]]:
    """(field, stored value, new value) of every field that differs, by command-line path."""
    a = config_lib.field_paths(config_lib.to_dict(stored))
    b = config_lib.field_paths(config_lib.to_dict(new))
    return [
        (key, a.get(key), b.get(key))
        for key in sorted(set(a) | set(b))
        if a.get(key) != b.get(key) and key not in _FREE_ON_RESUME
    ]


def check_resume(workdir: str, cfg: config_lib.ExperimentConfig) -> bool:
    """Whether this start resumes the run in `workdir`; a ConfigError when `cfg.resume` forbids
    it or the stored config differs (the message lists the fields). With `resume="must"` a larger
    `steps` is allowed: extending a run is then said on the command line, never implied."""
    if not holds_run(workdir):
        if cfg.resume == "must":
            raise config_lib.ConfigError(f"resume: 'must', but {workdir} holds no run to resume")
        return False
    if cfg.resume == "never":
        raise config_lib.ConfigError(
            f"resume: 'never', but {workdir} already holds a run; choose another --config.workdir"
        )
    if not (epath.Path(workdir) / "config.json").is_file():
        raise config_lib.ConfigError(
            f"workdir: {workdir} has checkpoints but no config.json, so resuming it cannot be "
            "checked; move the checkpoints away or choose another --config.workdir"
        )
    try:
        stored = read_run_config(workdir)
    except (ValueError, config_lib.ConfigError) as error:  # JSONDecodeError is a ValueError
        raise config_lib.ConfigError(
            f"workdir: the stored config of {workdir} cannot be read ({error}); "
            "choose another --config.workdir"
        ) from None
    diff = config_diff(stored, cfg)
    if cfg.resume == "must":
        diff = [d for d in diff if not (d[0] == "steps" and d[2] >= d[1])]
    if diff:
        lines = "\n".join(f"  {key}: {old!r} (stored) -> {now!r} (now)" for key, old, now in diff)
        extend = (
            " To extend the run to more steps, pass --config.resume=must."
            if [d[0] for d in diff] == ["steps"]
            else ""
        )
        raise config_lib.ConfigError(
            f"workdir: {workdir} holds a run with another config; resuming it would mix two "
            f"experiments. Differing fields:\n{lines}\nChoose another --config.workdir, or "
            f"restore the stored values.{extend}"
        )
    return True


def _git_state() -> dict:
    """The commit of the checkout this package runs from, and whether its tracked files differ
    from it; empty outside a git checkout (an installed wheel)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", root, *args], capture_output=True, text=True, timeout=20
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def _packages() -> dict[str, str]:
    found = {}
    for name in _RECORDED_PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def record_launch(
    workdir: str, cfg: config_lib.ExperimentConfig, resumed_step: int | None, kind: str
) -> dict:
    """Appends this start of the run to `launches.jsonl`: what ran it, on what, from where; the
    record is returned (trackers take it as the run's parameters)."""
    import jax

    devices = jax.devices()
    record = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kind": kind,
        "resumed_step": resumed_step,
        "command": [sys.executable, *sys.argv],
        "cwd": os.getcwd(),
        "host": platform.node(),
        "git": _git_state(),
        "python": platform.python_version(),
        "packages": _packages(),
        "devices": {
            "platform": devices[0].platform,
            "kind": devices[0].device_kind,
            "count": len(devices),
            "processes": jax.process_count(),
        },
        "config": config_lib.to_dict(cfg),
    }
    append_line(epath.Path(workdir) / LAUNCHES, json.dumps(record))
    return record


def read_run_config(workdir: str) -> config_lib.ExperimentConfig:
    """A run's stored config, with the fields of older versions carried to their new names."""
    check_run_folder(workdir, "workdir")
    data = json.loads((epath.Path(workdir) / "config.json").read_text())
    return config_lib.from_dict(config_lib.ExperimentConfig, upgrade_stored_config(data))


def upgrade_stored_config(data: dict) -> dict:
    """Renamed fields of older configs: data.task_max_ops became data.tasks, the phase data
    "builtin_tasks" became "tasks", rl.heldout_tasks (a count) became rl.heldout_num_tasks, the
    held-out splits "functions" / "instances" became "held_out" / "train", and the weights
    rl.reward_weight_<name> became rl.behaviour_rewards items (communication, which scored a
    missing final message, is now "answered"). Those flat rl fields then move into their
    sections in `config.from_dict` (`RLConfig.MOVED`)."""
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
    weights = {k: rl.pop(k) for k in list(rl) if k.startswith("reward_weight_")}
    if weights:
        names = {"communication": "answered"}
        rl["behaviour_rewards"] = [
            f"{names.get(k[len('reward_weight_') :], k[len('reward_weight_') :])}={w}"
            for k, w in weights.items()
            if w
        ]
    return data


def check_run_folder(path: str, what: str) -> str:
    """A finished run's folder (with its config.json), or a ConfigError naming the field `what`."""
    if not (run_path(path, what) / "config.json").is_file():
        raise config_lib.ConfigError(f"{what}: {path!r} is not a run folder (no config.json there)")
    return path


def check_local_output(path: str, field: str) -> None:
    """A local file a run writes at its end (e.g. `rl.trace`) can be written there: its nearest
    existing folder is a writable folder and the path itself is not a folder; else a ConfigError
    naming `field`, before anything runs (nothing is created here)."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise config_lib.ConfigError(f"{field}: {path!r} is a folder, not a file")
    parent = os.path.dirname(target)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise config_lib.ConfigError(f"{field}: {path!r} cannot be written ({parent} is a file)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise config_lib.ConfigError(f"{field}: {path!r} cannot be written ({parent} is read-only)")


def append_line(path: epath.Path, line: str) -> None:
    """Appends one line; object stores cannot append, so there the object is rewritten whole."""
    if is_remote(path):
        old = path.read_text() if path.exists() else ""
        path.write_text(old + line + "\n")
    else:
        with open(path, "a") as f:
            f.write(line + "\n")
