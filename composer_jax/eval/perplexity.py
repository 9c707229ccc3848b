"""Strided (sliding-window) perplexity of a language model over a whole codebase.

A window is `window` input tokens scored against their `window` next tokens, i.e. it spans
window + 1 tokens of the sequence. Window k starts at k * stride; the first window scores all of
its targets, every later one only the targets no earlier window scored (its last `stride`), with
the rest of the window as context. The last window is moved back to end exactly at the final
token, so all windows but a too-short sequence's only one are full length, and it scores just the
remaining targets. Every token except the leading [bos] is thus scored exactly once.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from composer_jax.data.corpus import list_source_files, read_source

# Joins files into one text: a newline so a file's last line never merges with the next file's
# first line.
FILE_SEPARATOR = "\n"


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    """Totals of an evaluation plus the per-token / per-byte rates derived from them."""

    total_nll: float  # nats, summed over scored tokens
    num_tokens: int  # scored tokens
    num_bytes: int  # UTF-8 bytes of the evaluated text
    nll_per_token: float = dataclasses.field(init=False)
    bits_per_byte: float = dataclasses.field(init=False)
    perplexity: float = dataclasses.field(init=False)

    def __post_init__(self):
        nll_per_token = self.total_nll / self.num_tokens
        object.__setattr__(self, "nll_per_token", nll_per_token)
        object.__setattr__(self, "bits_per_byte", self.total_nll / math.log(2) / self.num_bytes)
        object.__setattr__(self, "perplexity", math.exp(nll_per_token))


def window_starts(n_tokens: int, window: int, stride: int) -> list[int]:
    """First input index of each window over a sequence of n_tokens (n_tokens - 1 targets)."""
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in (0, window={window}], got {stride}")
    last_start = n_tokens - 1 - window
    if last_start <= 0:
        return [0]
    return list(range(0, last_start, stride)) + [last_start]


@jax.jit
def _target_nll(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    log_probs_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(log_probs_BTV, targets_BT[..., None], axis=-1)[..., 0]


def strided_nll(
    logits_fn: Callable[[np.ndarray], jax.Array],
    tokens: np.ndarray,
    *,
    window: int,
    stride: int,
    pad_id: int,
    batch_size: int = 8,
    progress: bool = False,
) -> tuple[float, int]:
    """(summed next-token NLL in nats, number of scored tokens) of `tokens` under `logits_fn`.

    Windows are evaluated batch_size at a time as [batch_size, window] int32 arrays, so
    `logits_fn` sees one shape and compiles once. Rows past the last window, and the tail of a
    sequence shorter than one window, are filled with pad_id and not scored; padding only ever
    follows real tokens, which a causal model never attends to.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tokens = np.asarray(tokens, dtype=np.int32)
    n_tokens = len(tokens)
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, got {n_tokens}")
    starts = window_starts(n_tokens, window, stride)
    # Targets before `first_unscored` were scored by the previous window.
    first_unscored = [1] + [start + window + 1 for start in starts[:-1]]

    total_nll, num_scored = 0.0, 0
    num_batches = -(-len(starts) // batch_size)
    for batch in tqdm(range(num_batches), desc="perplexity", unit="batch", disable=not progress):
        inputs_BT = np.full((batch_size, window), pad_id, dtype=np.int32)
        targets_BT = np.full((batch_size, window), pad_id, dtype=np.int32)
        scored_BT = np.zeros((batch_size, window), dtype=bool)
        batch_windows = range(batch * batch_size, min((batch + 1) * batch_size, len(starts)))
        for row, k in enumerate(batch_windows):
            start = starts[k]
            length = min(window, n_tokens - 1 - start)
            inputs_BT[row, :length] = tokens[start : start + length]
            targets_BT[row, :length] = tokens[start + 1 : start + 1 + length]
            scored_BT[row, first_unscored[k] - start - 1 : length] = True
        nll_BT = np.asarray(_target_nll(logits_fn(inputs_BT), targets_BT), dtype=np.float64)
        total_nll += float(nll_BT[scored_BT].sum())
        num_scored += int(scored_BT.sum())
    return total_nll, num_scored


def read_codebase_text(
    root: str, extensions: Sequence[str] = (".py",), max_bytes: int | None = None
) -> str:
    """The files of `root` in list_source_files order joined by FILE_SEPARATOR.

    With max_bytes, reading stops once enough text is gathered and the UTF-8 encoding is cut to
    max_bytes (dropping a character split by the cut).
    """
    paths = list_source_files(root, extensions)
    if not paths:
        raise ValueError(f"no {'/'.join(extensions)} files found under code root {root!r}")
    texts, size = [], 0
    for path in paths:
        texts.append(read_source(path))
        size += len(texts[-1].encode("utf-8")) + len(FILE_SEPARATOR)
        if max_bytes is not None and size >= max_bytes:
            break
    text = FILE_SEPARATOR.join(texts)
    if max_bytes is not None:
        text = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    return text


def codebase_perplexity(
    logits_fn: Callable[[np.ndarray], jax.Array],
    tokenizer,
    root: str,
    extensions: Sequence[str] = (".py",),
    *,
    window: int,
    stride: int,
    batch_size: int = 8,
    max_bytes: int | None = None,
    progress: bool = False,
) -> PerplexityResult:
    """Strided perplexity of `logits_fn` ([B, T] int32 -> [B, T, V] logits) on a directory.

    The text is tokenized once with a leading [bos]; see the module docstring for the windows.
    """
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in (0, window={window}], got {stride}")
    text = read_codebase_text(root, extensions, max_bytes)
    tokens = tokenizer.encode(text, add_bos=True, special=False)  # as training reads code
    total_nll, num_tokens = strided_nll(
        logits_fn,
        tokens,
        window=window,
        stride=stride,
        pad_id=tokenizer.pad_id,
        batch_size=batch_size,
        progress=progress,
    )
    return PerplexityResult(total_nll, num_tokens, tokenizer.num_bytes(text))
