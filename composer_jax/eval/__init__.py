"""Evaluations: codebase perplexity."""

from composer_jax.eval.perplexity import (
    PerplexityResult,
    codebase_perplexity,
    read_codebase_text,
    strided_nll,
    window_starts,
)

__all__ = [
    "PerplexityResult",
    "codebase_perplexity",
    "read_codebase_text",
    "strided_nll",
    "window_starts",
]
