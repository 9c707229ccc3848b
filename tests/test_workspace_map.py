"""WORKSPACE.md stays a map: short enough to hold, and every path it names exists."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_CHARACTERS = 15_000


def named_paths(text: str) -> list[str]:
    """Backticked repository paths: a folder (ends in /) or a file with an extension, no
    wildcards, no placeholders."""
    found = []
    for token in re.findall(r"`([^`\s]+)`", text):
        path = token.split(":")[0]
        if "/" not in path or any(c in path for c in "*<>{}$") or path.startswith(("../", "gs:")):
            continue
        if path.endswith("/") or re.search(r"\.[a-z]+$", path):
            found.append(path)
    return found


def test_the_map_is_short_and_names_only_paths_that_exist():
    text = (REPO / "WORKSPACE.md").read_text(encoding="utf-8")
    assert len(text) < MAX_CHARACTERS, f"WORKSPACE.md has {len(text)} characters"
    paths = named_paths(text)
    assert len(paths) > 30  # the rooms and the plug-in examples
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"WORKSPACE.md names paths that do not exist: {missing}"
