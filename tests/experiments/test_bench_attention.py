"""bench_attention end to end: both forms measured at each length, key blocks holding less."""

from __future__ import annotations

from tests.experiments.bench_runner import run_bench


def test_both_forms_are_measured_and_key_blocks_hold_less_at_length():
    stdout = run_bench(
        "experiments.bench_attention", "--lengths=64,512", "--blocks=32", "--repeats=1"
    )
    rows = [line.split("|")[1:-1] for line in stdout.splitlines() if line.startswith("| 512 |")]
    forms = {cells[1].strip(): float(cells[4]) for cells in rows}
    assert set(forms) == {"dense", "blocks of 32"}
    assert forms["dense"] == 1.0 and forms["blocks of 32"] < 0.8
    assert "| 64 | blocks of 32 |" in stdout
