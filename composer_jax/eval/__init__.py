"""Evaluations: codebase perplexity, pass@k / best-of-K of coding tasks."""

from composer_jax.eval.passk import (
    EpisodeRecord,
    best_of_k,
    evaluate,
    format_table,
    pass_at_k,
    write_report,
)
from composer_jax.eval.perplexity import (
    PerplexityResult,
    codebase_perplexity,
    read_codebase_text,
    strided_nll,
    window_starts,
)

__all__ = [
    "EpisodeRecord",
    "PerplexityResult",
    "best_of_k",
    "codebase_perplexity",
    "evaluate",
    "format_table",
    "pass_at_k",
    "read_codebase_text",
    "strided_nll",
    "window_starts",
    "write_report",
]
