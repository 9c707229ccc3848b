"""Config errors and the dict <-> dataclass conversion that rejects unknown or mistyped fields."""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from typing import Any

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or inconsistent; the message names the field."""


def check(ok: bool, field: str, message: str) -> None:
    """Raises a ConfigError naming `field` unless `ok`."""
    if not ok:
        raise ConfigError(f"{field}: {message}")


def to_dict(cfg: Any) -> Any:
    """Dataclass tree -> plain dicts/lists (tuples of dataclasses become lists of dicts)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (tuple, list)):
        return [to_dict(v) for v in cfg]
    return cfg


def field_paths(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A config as plain dicts (`to_dict`, or read from JSON) -> {path: leaf} with paths as the
    command line writes them ("train.phases[0].seq_len"); lists of scalars are tuple leaves."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(field_paths(value, f"{prefix}.{key}" if prefix else key))
        return out
    if isinstance(tree, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in tree):
        out = {}
        for i, value in enumerate(tree):
            out.update(field_paths(value, f"{prefix}[{i}]"))
        return out
    return {prefix: tuple(tree) if isinstance(tree, (list, tuple)) else tree}


def _convert(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} does not fit {annotation}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a sequence, got {value!r}")
        (item_type, _) = typing.get_args(annotation)
        return tuple(_convert(v, item_type, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, where)
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if annotation in (bool, str):
        if not isinstance(value, annotation):
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported annotation {annotation}")


def from_dict(cls: type, data: Any, where: str = "config") -> Any:
    """Rebuilds dataclass `cls` from nested mappings, naming any unknown field or mistyped value."""
    if dataclasses.is_dataclass(data):
        data = to_dict(data)
    if hasattr(data, "to_dict"):  # ml_collections.ConfigDict
        data = data.to_dict()
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    data = _relocate_moved(cls, data, known, where)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{where}.{unknown[0]}: unknown field of {cls.__name__} "
            f"(known: {', '.join(sorted(known))})"
        )
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    return cls(**kwargs)


def _relocate_moved(cls: type, data: dict, known: set[str], where: str) -> dict:
    """Old names of fields that moved into a section (`cls.MOVED`: old name -> "section.name")
    put where they now live, so an older run's config.json or config file still loads; one
    warning line names each new path (kept for one release)."""
    moved = {k: v for k, v in getattr(cls, "MOVED", {}).items() if k in data and k not in known}
    if not moved:
        return data
    data = dict(data)
    for old, new in moved.items():
        section, _, name = new.partition(".")
        inner = data.get(section)
        inner = dict(inner.to_dict() if hasattr(inner, "to_dict") else inner or {})
        inner[name] = data.pop(old)
        data[section] = inner
    log.warning(
        "%s: fields moved into sections (the old paths are read for one release): %s",
        where,
        ", ".join(f"{where}.{old} is now {where}.{new}" for old, new in moved.items()),
    )
    return data
