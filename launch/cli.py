"""Command-line handling shared by the entry points: `--config` as a preset name or a file, and
bad command lines answered with one line instead of a traceback."""

import os
import sys

from absl import app, flags
from ml_collections import config_flags

from composer_jax import config as config_lib

PRESET_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preset_config.py")


def define_config(default_preset: str | None) -> flags.FlagHolder:
    """`--config`: a preset name (`--config=tiny`) or a config file (`--config=path.py`), then
    any field overridden with `--config.<field>=<value>`."""
    default = f"{PRESET_FILE}:{default_preset}" if default_preset else None
    # ml_collections reads the command line here (to define one flag per override), so preset
    # names are resolved first and a bad override is reported now.
    sys.argv[1:] = _resolve_presets(sys.argv[1:])
    try:
        return config_flags.DEFINE_config_file(
            "config",
            default,
            f"Preset name ({', '.join(sorted(config_lib.PRESETS))}) or config file.",
            lock_config=True,
        )
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        _fail(f"bad --config override: {_message(error)}")


def _resolve_presets(argv: list[str]) -> list[str]:
    """Rewrites `--config=NAME` (or `--config NAME`) naming a preset into the preset file."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        value = None
        if arg.startswith("--config="):
            value = arg.removeprefix("--config=")
        elif arg == "--config" and i + 1 < len(argv):
            value, i = argv[i + 1], i + 1
        if value is not None:
            if value in config_lib.PRESETS:
                value = f"{PRESET_FILE}:{value}"
            elif not os.path.isfile(value.split(":")[0]):
                _fail(
                    f"--config={value}: neither a preset "
                    f"({', '.join(sorted(config_lib.PRESETS))}) nor a config file"
                )
            arg = f"--config={value}"
        out.append(arg)
        i += 1
    return out


def _message(error: Exception) -> str:
    """ml_collections reports an unknown field as a KeyError of its quoted name: name the whole
    override it came from."""
    text = str(error).strip("\"'")
    if not isinstance(error, (AttributeError, KeyError)):
        return text
    culprit = next(
        (a.split("=")[0] for a in sys.argv if a.startswith("--config.") and f".{text}" in a), None
    )
    return f"{culprit}: no such field" if culprit else f"no field {text!r}"


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _parse(argv: list[str]) -> list[str]:
    """Parses flags; unknown flags or config fields, bad values and positional arguments end the
    program with a one-line error."""
    try:
        rest = flags.FLAGS(_resolve_presets(argv))
        if "config" in flags.FLAGS:
            flags.FLAGS.config  # noqa: B018 -- applies the --config.<field> overrides now
    except flags.Error as error:
        _fail(str(error))
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        _fail(f"bad --config override: {_message(error)}")
    if len(rest) > 1:
        _fail(
            f"unexpected positional argument(s) {rest[1:]}; settings are flags "
            f"(--config.<field>=<value>), see --help"
        )
    return rest


def run(main) -> None:
    """`absl.app.run(main)` with this module's flag parsing."""
    app.run(main, flags_parser=_parse)
