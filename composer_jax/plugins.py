"""One way to name a plug-in (a workflow, tool, behaviour reward, judge, feedback detector):
a name registered in its registry, or `module:attribute`, imported on first use. Stdlib only, so
`envs/` and `agent/` both use it."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def resolve(registry: Mapping[str, Any], name: str, what: str) -> Any:
    """`registry[name]`, else the attribute `module:attribute` names; a ValueError that names
    `what` and the registered names when neither fits."""
    if name in registry:
        return registry[name]
    module, _, attribute = name.partition(":")
    if not (module and attribute):
        raise ValueError(
            f"unknown {what} {name!r}; registered: {', '.join(sorted(registry))} "
            "(or one by import path, module:attribute)"
        )
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"{what} {name!r} cannot be imported: {error}") from None
