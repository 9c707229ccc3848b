"""A run's tokenizer (`train.loop.load_run` reads a finished run back with it).

One tokenizer per run: `data.tokenizer` names it ("auto" takes the `init_from` checkpoint's
tokenizer when that folder has one, else the RL warm start run's, else the byte tokenizer); the
run keeps a copy of its files in `<workdir>/tokenizer/` (nothing for the byte tokenizer), so
`load_run`, a warm start and `launch.export` find it even if the source folder moves. A tokenizer
that differs from the one the checkpoint or warm start was trained with is refused.
The copy in a bucket workdir is read through a local copy (the tokenizer libraries read files).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

from etils import epath

from composer_jax import config as config_lib
from composer_jax.data.tokenizer import (
    BYTE,
    ByteTokenizer,
    Tokenizer,
    TokenizerError,
    check_vocab,
    load_tokenizer,
)
from composer_jax.train.workdir import is_remote

TOKENIZER_DIR = "tokenizer"
AUTO = "auto"


def has_tokenizer_files(folder: str) -> bool:
    return any(
        (epath.Path(folder) / name).is_file() for name in ("tokenizer.json", "tiktoken.model")
    )


def _load_saved(folder: epath.Path) -> Tokenizer:
    """The tokenizer in a run's folder; a bucket's files are copied to a local folder first, kept
    for the process's life (the tokenizer's `files()` point there) and removed at its exit."""
    if not is_remote(folder):
        return load_tokenizer(str(folder))
    local = tempfile.mkdtemp(prefix="run-tokenizer-")
    atexit.register(shutil.rmtree, local, ignore_errors=True)
    for file in folder.iterdir():
        file.copy(epath.Path(local) / file.name)
    return load_tokenizer(local)


def run_tokenizer(workdir: str) -> Tokenizer:
    """The tokenizer a run was trained with: its saved copy, else its config's (old runs)."""
    saved = epath.Path(workdir) / TOKENIZER_DIR
    if has_tokenizer_files(saved):
        return _load_saved(saved)
    path = epath.Path(workdir) / "config.json"
    if not path.exists():
        raise TokenizerError(f"{workdir}: not a run folder (no config.json)")
    spec = json.loads(path.read_text()).get("data", {}).get("tokenizer", BYTE)
    return ByteTokenizer() if spec in (AUTO, BYTE, "") else load_tokenizer(spec)


def _inherited(cfg: config_lib.ExperimentConfig) -> list[tuple[str, Tokenizer]]:
    """(where, tokenizer) of what this run starts from: an HF checkpoint, an RL warm start."""
    found = []
    if cfg.init_from and has_tokenizer_files(cfg.init_from):
        found.append(("init_from", load_tokenizer(cfg.init_from)))
    if cfg.rl.warm_start:
        found.append(("rl.warm_start", run_tokenizer(cfg.rl.warm_start)))
    return found


def resolve_tokenizer(cfg: config_lib.ExperimentConfig) -> Tokenizer:
    """The run's tokenizer (see the module docstring); errors name the config field."""
    try:
        inherited = _inherited(cfg)
        if cfg.data.tokenizer == AUTO:
            tokenizer = inherited[0][1] if inherited else ByteTokenizer()
        else:
            tokenizer = load_tokenizer(cfg.data.tokenizer)
        for where, other in inherited:
            if other.fingerprint() != tokenizer.fingerprint():
                raise config_lib.ConfigError(
                    f"data.tokenizer: {tokenizer.spec!r} is not the tokenizer {where} was "
                    f"trained with ({other.spec!r}); leave data.tokenizer='auto' to use it"
                )
        check_vocab(tokenizer, cfg.model.vocab_size)
    except TokenizerError as e:
        raise config_lib.ConfigError(f"data.tokenizer: {e}") from None
    return tokenizer


def check_run_tokenizer(workdir: str, tokenizer: Tokenizer) -> None:
    """A resumed run keeps its tokenizer: the copy it saved must be `tokenizer` (the same
    `data.tokenizer` path whose files changed would go on training on other ids)."""
    folder = epath.Path(workdir) / TOKENIZER_DIR
    if not has_tokenizer_files(folder):
        return
    saved = _load_saved(folder)
    if saved.fingerprint() != tokenizer.fingerprint():
        raise config_lib.ConfigError(
            f"data.tokenizer: {tokenizer.spec!r} is not the tokenizer {workdir} was trained "
            f"with (its copy in {folder}); restore it or choose another --config.workdir"
        )


def save_run_tokenizer(tokenizer: Tokenizer, workdir: str) -> None:
    """Keeps a copy of the tokenizer's files with the run (the byte tokenizer needs none)."""
    if isinstance(tokenizer, ByteTokenizer):
        return
    folder = epath.Path(workdir) / TOKENIZER_DIR
    if has_tokenizer_files(folder) and _load_saved(folder).fingerprint() == tokenizer.fingerprint():
        return
    if not is_remote(workdir):
        tokenizer.save(str(folder))
        return
    with tempfile.TemporaryDirectory() as local:  # the tokenizer writes local files
        tokenizer.save(local)
        folder.mkdir(parents=True, exist_ok=True)
        for name in os.listdir(local):
            epath.Path(local, name).copy(folder / name, overwrite=True)
