"""Record files of the actor loop (ledger, in-flight records) in a local folder or a bucket.

A local record is made visible by an atomic rename (written to a temporary name in the same
folder, fsynced, renamed, folder fsynced), so a crash leaves it complete or absent. A bucket
object is written whole or not at all by the store itself, so there it is written directly:
no temporary object, no rename (which a bucket would do as copy + delete). URIs go through
`etils.epath`; `os.path` would turn `gs://b` into a local folder named `gs:`. No JAX here."""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable
from typing import BinaryIO

from etils import epath

TMP_PREFIX = ".tmp-"  # a local write that has not been renamed into place yet


def is_remote(path: str) -> bool:
    """Whether `path` is a URI (a bucket), not a local path."""
    return "://" in str(path)


def absolute(path: str) -> str:
    """A local path made absolute; a URI as it is."""
    return str(path) if is_remote(path) else os.path.abspath(path)


def make_dirs(directory: str) -> None:
    if is_remote(directory):
        epath.Path(directory).mkdir(parents=True, exist_ok=True)
    else:
        os.makedirs(directory, exist_ok=True)


def list_names(directory: str) -> list[str]:
    """The names in `directory`; [] for a bucket prefix that holds no object yet."""
    if not is_remote(directory):
        return os.listdir(directory)
    folder = epath.Path(directory)
    return [child.name for child in folder.iterdir()] if folder.exists() else []


def exists(path: str) -> bool:
    return epath.Path(path).exists() if is_remote(path) else os.path.exists(path)


def open_binary(path: str) -> BinaryIO:
    """The record for reading (seekable, as `np.load` needs)."""
    return epath.Path(path).open("rb") if is_remote(path) else open(path, "rb")


def remove(path: str) -> None:
    if is_remote(path):
        epath.Path(path).unlink()
    else:
        os.remove(path)


def move(source: str, target: str) -> None:
    """Renames a record (to set a damaged one aside); replaces `target` if it exists."""
    if is_remote(source):
        epath.Path(source).replace(target)
    else:
        os.replace(source, target)


def sync_dir(directory: str) -> None:
    """Makes the renames and removals in a local folder durable (a bucket's already are)."""
    if is_remote(directory):
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Calls `write(file)` and makes the result visible at `path` all at once."""
    if is_remote(path):
        buffer = io.BytesIO()
        write(buffer)
        epath.Path(path).write_bytes(buffer.getvalue())
        return
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f"{TMP_PREFIX}{name}.{os.getpid()}.{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    sync_dir(directory)
