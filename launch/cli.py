"""Command-line handling shared by the entry points.

`--config` is a preset name, a config file (`FILE.py`, or `FILE.py:variant`, whose text after ':'
ml_collections passes to `get_config`) or a JSON file of a whole config (what `--print_config`
prints). Any field is overridden with `--config.<field>=<value>`: ml_collections parses the plain
ones; fields that are tuples or may be None (and anything under them) are parsed here, by the
dataclass annotation of the field, since ml_collections types a field by its current value:
  --config.mesh.ep=fsdp,cp            --config.mesh.ep='("fsdp",)'     --config.mesh.ep=
  --config.model.q_lora_rank=None     --config.model.rope_scaling.factor=8  (from the defaults)
  --config.train.phases[1].seq_len=64 --config.train.phases='[{"name": "main"}]'
Bad command lines end with one line on stderr and exit status 2, not a traceback.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import os
import re
import sys
import types
import typing

from absl import app, flags
from ml_collections import config_flags

from composer_jax import config as config_lib
from composer_jax import presets

LAUNCH_DIR = os.path.dirname(os.path.abspath(__file__))
PRESET_FILE = os.path.join(LAUNCH_DIR, "preset_config.py")
JSON_CONFIG_FILE = os.path.join(LAUNCH_DIR, "json_config.py")

# (`--config.<path>`, raw value) of the overrides parsed here, in command-line order.
_TYPED_OVERRIDES: list[tuple[str, str]] = []
# One line for each old flat `--config.rl.<field>` given, printed when the flags are parsed: an
# entry point may execute itself again in between (`malloc`), which would print them twice.
_MOVED_WARNINGS: list[str] = []


class CommandLineError(ValueError):
    """A bad flag value; the message names the flag."""


def define_config(default_preset: str | None) -> flags.FlagHolder:
    """`--config`: a preset name (`--config=tiny`), a config file (`--config=path.py[:variant]`)
    or a JSON config, then any field overridden with `--config.<field>=<value>`."""
    default = f"{PRESET_FILE}:{default_preset}" if default_preset else None
    # ml_collections reads the command line here (to define one flag per override), so preset
    # names are resolved and typed overrides taken out first, and a bad override is reported now.
    argv, typed = _split_typed_overrides(_moved_overrides(_resolve_presets(sys.argv[1:])))
    sys.argv[1:] = argv
    _TYPED_OVERRIDES[:] = typed
    flags.DEFINE_bool(
        "print_config", False, "Print the resolved config (JSON, loadable with --config=FILE.json)."
    )
    try:
        return config_flags.DEFINE_config_file(
            "config",
            default,
            f"Preset name ({', '.join(sorted(presets.PRESETS))}), config file "
            "(FILE.py[:variant]) or JSON config.",
            lock_config=True,
        )
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        fail(f"bad --config override: {_message(error)}")


def define_run_folder(help_text: str) -> typing.Callable[[], str]:
    """`--config.workdir` for an entry point that reads a run (evaluate, eval, export): the run's
    folder has the one name it has everywhere. `--workdir`, its old spelling here, still works
    and warns once. Returns the folder given ("" when none)."""
    new = flags.DEFINE_string("config.workdir", "", help_text)
    old = flags.DEFINE_string("workdir", "", "Old spelling of --config.workdir.")

    @functools.cache
    def value() -> str:
        if old.value and new.value and old.value != new.value:
            fail("give the run folder once, as --config.workdir (--workdir is its old spelling)")
        if old.value and not new.value:
            print("warning: --workdir is now --config.workdir", file=sys.stderr)
        return new.value or old.value

    return value


def experiment_config(holder: flags.FlagHolder) -> config_lib.ExperimentConfig:
    """The typed config: the loaded config with every override applied, the architecture of an
    `init_from` checkpoint adopted, checked field by field and as a whole (`config.validate`, as
    every run does; whether it fits the devices is the run's check). With `--print_config`,
    prints it and exits."""
    data = holder.value.to_dict()
    try:
        for path, raw in _TYPED_OVERRIDES:
            _apply_typed_override(data, path, raw)
        cfg = config_lib.from_dict(config_lib.ExperimentConfig, data)
        if cfg.init_from:  # the architecture comes from the checkpoint's config.json
            # Imported here: interop needs JAX, which no other command line should pay for.
            from composer_jax import interop

            cfg = interop.with_checkpoint_architecture(cfg)
        config_lib.validate(cfg)
    except (CommandLineError, config_lib.ConfigError) as error:
        fail(str(error))
    if flags.FLAGS.print_config:
        print(json.dumps(config_lib.to_dict(cfg), indent=2))
        sys.exit(0)
    return cfg


# ----------------------------------------------------------------------------- --config value


def _resolve_presets(argv: list[str]) -> list[str]:
    """Rewrites `--config=NAME` (or `--config NAME`) naming a preset into the preset file and a
    JSON config into the JSON loader; anything else must be an existing file."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        value = None
        if arg.startswith("--config="):
            value = arg.removeprefix("--config=")
        elif arg == "--config" and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
        if value is not None:
            path = value.split(":")[0]
            if value in presets.PRESETS:
                value = f"{PRESET_FILE}:{value}"
            elif value.endswith(".json") and os.path.isfile(value):
                value = f"{JSON_CONFIG_FILE}:{os.path.abspath(value)}"
            elif not os.path.isfile(path):
                fail(
                    f"--config={value}: neither a preset "
                    f"({', '.join(sorted(presets.PRESETS))}) nor a config file"
                )
            arg = f"--config={value}"
        out.append(arg)
        i += 1
    return out


# ----------------------------------------------------------------------------- typed overrides


def _moved_overrides(argv: list[str]) -> list[str]:
    """`--config.rl.<old>` of a field that moved into a section of rl (`RLConfig.MOVED`)
    rewritten to its new path, with a one-line warning in `_MOVED_WARNINGS` (the old paths work
    for one release)."""
    out = []
    for arg in argv:
        match = re.fullmatch(r"(--?config\.rl\.)(\w+)([=\[.].*)?", arg, flags=re.DOTALL)
        new = match and config_lib.RLConfig.MOVED.get(match.group(2))
        if new:
            _MOVED_WARNINGS.append(
                f"warning: --config.rl.{match.group(2)} is now --config.rl.{new}"
            )
            arg = f"{match.group(1)}{new}{match.group(3) or ''}"
        out.append(arg)
    return out


def _split_path(path: str) -> list[str | int]:
    """`train.phases[1].seq_len` -> ["train", "phases", 1, "seq_len"]."""
    parts: list[str | int] = []
    for name in path.split("."):
        match = re.fullmatch(r"([A-Za-z_]\w*)((?:\[\d+\])*)", name)
        if not match:
            raise CommandLineError(f"--config.{path}: cannot read the field path")
        parts.append(match.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    return parts


def _optional(annotation) -> tuple[object, bool]:
    """(the annotation without None, whether None is allowed)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) == 1:
            return options[0], True
    return annotation, False


def _annotations_along(path: str) -> list[object] | None:
    """The annotation of every step of `path` in ExperimentConfig, or None if a field along it
    does not exist (ml_collections then names it)."""
    annotation: object = config_lib.ExperimentConfig
    found = []
    for part in _split_path(path):
        annotation, _ = _optional(annotation)
        if isinstance(part, int):
            if typing.get_origin(annotation) is not tuple:
                return None
            annotation = typing.get_args(annotation)[0]
        elif dataclasses.is_dataclass(annotation):
            hints = typing.get_type_hints(annotation)
            if part not in hints:
                return None
            annotation = hints[part]
        else:
            return None
        found.append(annotation)
    return found


def _needs_typed_parse(path: str, value: str | None) -> bool:
    """Tuples and optional fields, every field under one, and None for any field (which gets a
    clear refusal if it cannot be None) are parsed here."""
    annotations = _annotations_along(path)
    if annotations is None:
        return False
    if value is not None and value.strip() in ("None", "none"):
        return True
    return any(typing.get_origin(a) is tuple or _optional(a)[1] for a in annotations)


def _split_typed_overrides(argv: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Takes out `--config.<path>=<value>` (or `--config.<path> <value>`) overrides that are
    parsed here; returns the rest of the command line and those overrides in order."""
    rest, typed, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        match = re.fullmatch(r"--?config\.([^=]+)(?:=(.*))?", arg, flags=re.DOTALL)
        following = argv[i + 1] if i + 1 < len(argv) else None
        value = match.group(2) if match and match.group(2) is not None else following
        if match and _needs_typed_parse(match.group(1), value):
            value = match.group(2)
            if value is None:
                if i + 1 >= len(argv):
                    fail(f"--config.{match.group(1)}: needs a value")
                value, i = argv[i + 1], i + 1
            typed.append((match.group(1), value))
        else:
            rest.append(arg)
        i += 1
    return rest, typed


def _parse_value(raw: str, annotation, where: str):
    """`raw` as a value of `annotation`; tuples of dataclasses come as literals of dicts and are
    checked later by `config.from_dict`."""
    annotation, optional = _optional(annotation)
    if raw.strip() in ("None", "none"):
        if not optional:
            raise CommandLineError(f"{where}: cannot be None")
        return None
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        text = raw.strip()
        if text.startswith(("(", "[")):
            values = _literal(text, where)
            if not isinstance(values, (list, tuple)):
                raise CommandLineError(f"{where}: expected a sequence, got {raw!r}")
        else:
            values = [v.strip() for v in text.split(",")] if text else []
        return [_parse_item(v, item, f"{where}[{i}]") for i, v in enumerate(values)]
    if dataclasses.is_dataclass(annotation):
        value = _literal(raw, where)
        if not isinstance(value, dict):
            raise CommandLineError(f"{where}: expected a dict of {annotation.__name__} fields")
        return {**config_lib.to_dict(annotation()), **value}
    return _parse_item(raw, annotation, where)


def _parse_item(value, annotation, where: str):
    """One scalar from its text (or a literal already parsed)."""
    if not isinstance(value, str) or annotation is str:
        return value
    try:
        if annotation is bool:
            if value.lower() in ("true", "1"):
                return True
            if value.lower() in ("false", "0"):
                return False
            raise ValueError(value)
        if annotation is int:
            return int(value)
        if annotation is float:
            return float(value)
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a number"}[annotation]
        raise CommandLineError(f"{where}: {value!r} is not {kind}") from None
    return _literal(value, where)


def _literal(text: str, where: str):
    try:
        return ast.literal_eval(text)
    except (SyntaxError, ValueError):
        raise CommandLineError(f"{where}: cannot read {text!r} as a Python literal") from None


def _apply_typed_override(data: dict, path: str, raw: str) -> None:
    """Sets `path` in the plain config dict; an optional dataclass that is None is first filled
    with its defaults so one of its fields can be set."""
    where = f"--config.{path}"
    parts = _split_path(path)
    annotations = _annotations_along(path)
    if annotations is None:
        raise CommandLineError(f"{where}: no such field")
    node = data
    for depth, part in enumerate(parts[:-1]):
        if isinstance(part, int):
            if part >= len(node):
                raise CommandLineError(f"{where}: index {part} is out of range ({len(node)})")
            child = node[part]
        else:
            child = node.get(part)
            if child is None:
                inner, _ = _optional(annotations[depth])
                child = node[part] = config_lib.to_dict(inner())
        node = child
    last = parts[-1]
    if isinstance(last, int) and last >= len(node):
        raise CommandLineError(f"{where}: index {last} is out of range ({len(node)})")
    node[last] = _parse_value(raw, annotations[-1], where)


# ----------------------------------------------------------------------------- errors, parsing


def _message(error: Exception) -> str:
    """ml_collections reports an unknown field as a KeyError (possibly wrapped) whose text is the
    quoted name, a newline and a suggestion: name the whole override it came from, on one line,
    with the suggestion."""
    while isinstance(error, (AttributeError, KeyError)) and error.args:
        inner = error.args[0]
        if not isinstance(inner, BaseException):
            break
        error = inner
    text = str(error.args[0]) if error.args else str(error)
    if not isinstance(error, (AttributeError, KeyError)):
        return " ".join(text.split())
    first, _, rest = text.partition("\n")
    quoted = re.search(r"[\"']([^\"']+)[\"']", first)
    name = quoted.group(1) if quoted else first.strip("\"' ")
    hint = re.search(r'Did you mean "([^"]+)"', rest)
    suggestion = f'; did you mean "{hint.group(1)}"?' if hint else ""
    overrides = [a.split("=")[0] for a in sys.argv if a.startswith("--config.")]
    culprit = next((o for o in overrides if o.rsplit(".", 1)[-1] == name), None)
    where = culprit or f"field {name!r}"
    return f"{where}: no such field{suggestion}"


def fail(message: str, status: int = 2) -> typing.NoReturn:
    """Ends the program with a one-line error: exit status 2 for bad input (flags, config, run
    folders), 1 for a failure once the run has started."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(status)


def _flag_error(error: flags.Error) -> str:
    """absl wraps an error raised while loading a config file with its whole traceback: keep the
    flag and the error's own last line."""
    text = str(error)
    if "Traceback" not in text:
        return text
    lines = [line for line in text.splitlines() if line.strip()]
    return f"{lines[0].rstrip(': ')}: {lines[-1].strip()}"


def _parse(argv: list[str], positional: bool = False) -> list[str]:
    """Parses flags; unknown flags or config fields, bad values and (unless the entry point takes
    them) positional arguments end the program with a one-line error. Old flat rl paths warn
    here, once."""
    for line in _MOVED_WARNINGS:
        print(line, file=sys.stderr)
    try:
        rest = flags.FLAGS(_resolve_presets(argv))
        if "config" in flags.FLAGS:
            flags.FLAGS.config  # noqa: B018 -- applies the --config.<field> overrides now
    except flags.Error as error:
        fail(_flag_error(error))
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        fail(f"bad --config override: {_message(error)}")
    if len(rest) > 1 and not positional:
        fail(
            f"unexpected positional argument(s) {rest[1:]}; settings are flags "
            f"(--config.<field>=<value>), see --help"
        )
    return rest


# The top-level fields of ExperimentConfig that are not sections (dataclasses, described by their
# docstrings): what `--help` says of each.
_SCALAR_FIELDS = {
    "steps": "training steps (pretraining), or RL steps",
    "seed": "the run's seed (initialisation, data order, sampling)",
    "workdir": "the run's folder (a local path or gs://bucket/path); starting again resumes",
    "init_from": "a Hugging Face folder whose weights start a fresh run",
    "print_sharding": "print every parameter's sharding at start-up",
    "resume": "auto | never | must: what to do on a workdir that holds a run",
}


def config_help() -> str:
    """The config's top-level sections and fields, one line each, for `--help`."""
    lines = ["", "The config (--config=PRESET|FILE.py|FILE.json, then --config.<field>=<value>):"]
    for field in dataclasses.fields(config_lib.ExperimentConfig):
        section = getattr(config_lib, str(field.type), None)
        if dataclasses.is_dataclass(section):
            text = (section.__doc__ or "").strip().split("\n")[0]
        else:
            text = _SCALAR_FIELDS[field.name]
        lines.append(f"  {field.name:<15} {text}")
    lines.append("The whole tree with its values: --print_config. Every flag: --helpfull.")
    return "\n".join(lines) + "\n"


def _adopt_launch_flags() -> None:
    """The flags this package's modules define (`--config`, `--print_config`, progress and log
    flags) become the entry point's own, so `--help` lists them (absl lists only the flags the
    main module defines; `--helpfull` lists all)."""
    main = sys.argv[0]
    for module, defined in flags.FLAGS.flags_by_module_dict().items():
        if module != main and module.split(".")[0] == "launch":
            for flag in defined:
                flags.FLAGS.register_key_flag_for_module(main, flag)


def run(main, positional: bool = False) -> None:
    """`absl.app.run(main)` with this module's flag parsing; `positional`: main takes positional
    arguments (in its argv) instead of refusing them. `--help` lists the entry point's flags and,
    where it takes `--config`, the config's sections."""
    _adopt_launch_flags()
    if "config" in flags.FLAGS:
        entry = sys.modules["__main__"]
        entry.__doc__ = (entry.__doc__ or "") + config_help()
    app.run(main, flags_parser=lambda argv: _parse(argv, positional))
