"""sync_vs_async's summary and report: steps 2+ only, throughput from the step times, the
async / sync ratio printed."""

import pytest

from experiments import sync_vs_async


def _line(step, seconds, staleness=0.0, dropped=0):
    return dict(
        step=step,
        reward_mean=0.5,
        seconds_per_step=seconds,
        train_seconds=1.0,
        wait_seconds=seconds - 1.0,
        staleness_mean=staleness,
        groups_dropped_stale=dropped,
    )


def test_summary_skips_step_one_and_report_prints_the_ratio(capsys):
    sync_vs_async.flags.FLAGS(["sync_vs_async"])
    sync = sync_vs_async.summarize([_line(1, 30.0), _line(2, 4.0), _line(3, 4.0)], 16, {0: 4})
    fast = [_line(1, 30.0), _line(2, 2.0, 1.0, 1), _line(3, 2.0, 0.5)]
    async_ = sync_vs_async.summarize(fast + [{"step": 3}], 16, {0: 2, 1: 2})
    assert sync["seconds"] == 8.0 and sync["samples_per_s"] == pytest.approx(4.0)
    assert async_["staleness"] == pytest.approx(0.75) and async_["dropped"] == 1
    sync_vs_async.report({"sync": sync, "async": async_}, 16)
    out = capsys.readouterr().out
    assert "async / sync throughput: 2.00x" in out
    assert "{0: 2, 1: 2}" in out and "(ratio 3.00)" in out


def test_a_step_without_a_measured_reward_still_counts_as_a_step():
    """Every sample of step 3 was abandoned: its record has no reward_mean; its time counts."""
    abandoned = {k: v for k, v in _line(3, 4.0).items() if k != "reward_mean"}
    summary = sync_vs_async.summarize([_line(2, 4.0), abandoned], 16, {})
    assert summary["seconds"] == 8.0 and summary["reward"] == 0.5
