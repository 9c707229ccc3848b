"""Test-session set-up: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

import numpy as np
import pytest

# The tests' programs are small and compiled once or twice each, so compilation dominates the
# tier: LLVM without its expensive passes compiles them about a quarter faster (same numerics: it
# changes no floating-point semantics) and inherits into every subprocess a test starts.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Tests build the same programs many times (in both xdist workers and in subprocesses): share
# compiled executables through JAX's persistent cache, kept in the checkout (ignored by git, safe
# to delete) so a second run on the same clone starts warm.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


@pytest.fixture
def fresh_rng():
    """A numpy Generator on a new seed every run, so a test samples fresh inputs each time it
    runs; the seed is printed (pytest shows it beside a failure) and CJ_TEST_SEED=N repeats it."""
    seed = int(os.environ.get("CJ_TEST_SEED") or np.random.SeedSequence().entropy % 2**32)
    print(f"fresh_rng seed {seed}: CJ_TEST_SEED={seed} repeats this run's inputs")
    return np.random.default_rng(seed)


def pytest_terminal_summary(terminalreporter):
    """Ends the run with what ran per tier and every skip with its reason, so a contract that
    silently stopped running (the golden tier without transformers, a sandbox backend missing)
    shows in the log."""
    stats = terminalreporter.stats
    outcomes = ("passed", "failed", "error", "skipped")
    counts = {tier: dict.fromkeys(outcomes, 0) for tier in ("default", "slow")}
    for outcome in outcomes:
        for report in stats.get(outcome, []):
            # A module skipped at collection (importorskip) reports without keywords.
            tier = "slow" if "slow" in getattr(report, "keywords", ()) else "default"
            counts[tier][outcome] += 1
    markers = terminalreporter.config.getoption("markexpr") or ""
    write = terminalreporter.write_line
    for tier, count in counts.items():
        note = ""
        if tier == "slow" and "not slow" in markers:
            note = (
                " (the slow sample; python -m pytest -m slow runs the whole tier)"
                if "slow_sample" in markers
                else " (not in this run: python -m pytest -m slow)"
            )
        write(f"tier {tier}: " + ", ".join(f"{n} {k}" for k, n in count.items()) + note)
    for report in stats.get("skipped", []):
        path, line, reason = (
            report.longrepr
            if isinstance(report.longrepr, tuple)
            else (report.nodeid, None, str(report.longrepr))
        )
        write(f"  skipped {path}{'' if line is None else f':{line}'}: {reason}")
