"""Source-code corpora read straight from a directory tree.

The default corpus is the running interpreter's standard library: it is present on every machine,
needs no download, and is a few thousand files of real Python.
"""

import hashlib
import os
import sysconfig
from collections.abc import Sequence

DEFAULT_EXCLUDE_DIRS = (
    "site-packages",
    "__pycache__",
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "tkinter",
    "turtledemo",
)
SPLITS = ("train", "eval", "all")


def default_code_root() -> str:
    """The standard-library directory of the running interpreter."""
    return sysconfig.get_paths()["stdlib"]


def _relative_posix(path: str, root: str) -> str:
    return os.path.relpath(path, root).replace(os.sep, "/")


def list_source_files(
    root: str,
    extensions: Sequence[str] = (".py",),
    exclude_dirs: Sequence[str] = DEFAULT_EXCLUDE_DIRS,
) -> list[str]:
    """Paths of the files under `root` with one of `extensions`, skipping `exclude_dirs` anywhere.

    Sorted by path relative to `root` (with '/' separators) so the order is the same on every
    machine and every run, whatever order the filesystem lists directories in.
    """
    if not os.path.isdir(root):
        raise ValueError(f"code root {root!r} is not a directory")
    excluded = set(exclude_dirs)
    suffixes = tuple(extensions)
    paths = []
    for directory, subdirs, filenames in os.walk(root):
        subdirs[:] = [name for name in subdirs if name not in excluded]
        paths.extend(os.path.join(directory, name) for name in filenames if name.endswith(suffixes))
    return sorted(paths, key=lambda path: _relative_posix(path, root))


def read_source(path: str) -> str:
    """File text; undecodable bytes become U+FFFD rather than failing a long run."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def in_eval_split(relative_path: str, eval_fraction: float) -> bool:
    """Hash-based held-out assignment: stable across machines, runs and added files."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < eval_fraction


class CodeCorpus:
    """Random-access source of file texts (a grain data source: `len` and `[i] -> str`).

    `split` selects the files whose relative path hashes into the eval fraction ("eval"), the rest
    ("train"), or everything ("all"), so evaluation text is never trained on.
    """

    def __init__(
        self,
        root: str | None = None,
        extensions: Sequence[str] = (".py",),
        split: str = "all",
        eval_fraction: float = 0.02,
        exclude_dirs: Sequence[str] = DEFAULT_EXCLUDE_DIRS,
    ):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if not 0.0 <= eval_fraction <= 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
        self.root = default_code_root() if root is None else root
        self.split = split
        self.paths = [
            path
            for path in list_source_files(self.root, extensions, exclude_dirs)
            if split == "all"
            or in_eval_split(_relative_posix(path, self.root), eval_fraction) == (split == "eval")
        ]
        if not self.paths:
            raise ValueError(
                f"no {'/'.join(extensions)} files found under code root {self.root!r} "
                f"for split {split!r} (eval_fraction={eval_fraction})"
            )

    @property
    def relative_paths(self) -> list[str]:
        return [_relative_posix(path, self.root) for path in self.paths]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> str:
        return read_source(self.paths[index])

    def __repr__(self) -> str:
        return f"CodeCorpus(root={self.root!r}, split={self.split!r}, files={len(self)})"
