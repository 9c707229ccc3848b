"""bench_decode's forms table end to end: both spellings of each op timed; the engine's accurate.
Its prefill table: both spans timed."""

from __future__ import annotations

import re

from tests.experiments.bench_runner import run_bench


def test_forms_and_prefill_tables_time_both_forms_and_the_engines_is_accurate():
    stdout = run_bench(
        "experiments.bench_decode",
        "--tables=forms,prefill",
        "--repeats=1",
        "--form_calls=2",
        "--prefill_rows=1",
    )
    assert re.search(r"\| 1 \| [\d.]+ \| [\d.]+ \| [\d.]+x \|", stdout), stdout
    for label in (
        "| weighted sum: einsum bhts,bsr->bthr |",
        "| weighted sum: [B, H*T, S] @ [B, S, R] |",
        "| draw, top_p 0.95 (nucleus sort) |",
        "| draw, top_p 1 (sort skipped) |",
    ):
        assert label in stdout
    matmul_error = float(re.search(r"matmul (\S+) \(outputs", stdout).group(1))
    # Outputs are about 0.06 in size: the engine's spelling is within a bf16 rounding or two of
    # float32 products (the einsum it replaced accumulated in bf16: about 0.01 off).
    assert matmul_error < 2e-3
