"""bench_weight_sync runs end to end on the smallest presets: every rebuild bitwise, exit 0."""

import pytest

from tests.experiments.bench_runner import run_bench


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, done",
    [
        (["--presets=tiny", "--steps=2"], "add: rebuild from scratch (snapshot + 2 deltas)"),
        (["--rl_step", "--rl_presets=rl_tiny"], "rl_tiny: lr"),
    ],
    ids=["adamw_steps", "rl_step"],
)
def test_bench_weight_sync_runs(flags, done):
    out = run_bench("experiments.bench_weight_sync", *flags)
    assert done in out and "FAIL" not in out and "bitwise equal: False" not in out
