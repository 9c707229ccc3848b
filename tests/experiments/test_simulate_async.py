"""The actor-loop simulator against cases with known answers, its use of the scheduler's own
policy, and the cheap pieces of its calibration."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from composer_jax import presets
from composer_jax.actor import scheduler
from composer_jax.actor.simulation import Costs, Lengths, SimConfig, Workload, simulate
from composer_jax.config import RLConfig, RolloutConfig
from composer_jax.model import init_model
from experiments import simulate_async

FREE = Costs(
    decode_rows=(1, 8),
    decode_s=(0.01, 0.03),
    prefill_s_per_token=0.0,
    train_s_per_token=0.0,
    publish_s=0.0,
    rebuild_s=0.0,
    grading_s=0.0,
)
LONG_TAIL = Lengths(median=40, sigma=1.2)


def _config(
    costs: Costs = FREE,
    lengths: Lengths = Lengths(values=(50,)),
    steps: int = 10,
    workload: dict | None = None,
    rl: dict | None = None,
    **overrides,
) -> SimConfig:
    """One sampler of 8 slots, steps of 2 groups x 4, no staleness bound to speak of."""
    loop = {"group_size": 4, "groups_per_step": 2, "num_slots": 8, "max_new_tokens": 2000}
    rl = RLConfig(rollout=RolloutConfig(**{**loop, "max_staleness": 100, **(rl or {})}))
    work = Workload(lengths=lengths, prompt_tokens=100, **(workload or {}))
    return SimConfig(rl=rl, workload=work, costs=costs, steps=steps, **overrides)


def test_one_sampler_with_constant_lengths_and_a_free_trainer_runs_at_its_decode_rate():
    """Every 8 slots refill at once: a period is the prefill of two groups' shared prompts plus
    50 decode steps of 8 rows; the trainer (free) takes each period's two groups at its end."""
    costs = dataclasses.replace(FREE, prefill_s_per_token=1e-4)
    result = simulate(_config(costs, padded_decode=False))
    period = 2 * 100 * 1e-4 + 50 * 0.03
    assert result.seconds == pytest.approx(10 * period)
    assert result.samples_per_s == pytest.approx(8 / period)
    assert result.sampler_busy == pytest.approx(1.0) and result.slot_use == pytest.approx(
        50 * 0.03 / period
    )
    assert result.trained_samples == 80 and result.dropped_groups == 0


@pytest.mark.parametrize("turns", [1, 2])
def test_synchronous_throughput_is_one_batch_per_generation_plus_training(turns):
    """max_staleness 0: a step generates (prefill, decode, tool calls, grading), trains, then
    publishes and rebuilds the weights before the next step can start."""
    costs = Costs(
        decode_rows=(8,),
        decode_s=(0.03,),
        prefill_s_per_token=1e-4,
        train_s_per_token=1e-3,
        train_overhead_s=0.5,
        publish_s=0.2,
        rebuild_s=0.1,
        grading_s=0.3,
    )
    tool = {"turns": turns, "tool_s": 0.4, "tool_output_tokens": 20}
    result = simulate(_config(costs, rl={"max_staleness": 0}, trainer_ranks=2, workload=tool))
    extra_turns = turns - 1
    generate = 2 * 100 * 1e-4 + turns * 50 * 0.03 + 0.3
    generate += extra_turns * (0.4 + 8 * 20 * 1e-4)
    tokens = 8 * (100 + turns * 50 + extra_turns * 20)
    train = 1e-3 * tokens / 2 + 0.5
    assert result.seconds == pytest.approx(10 * (generate + train) + 9 * (0.2 + 0.1))
    assert result.staleness == {0: 20} and result.token_lag == 0
    assert result.trainer_busy == pytest.approx(10 * train / result.seconds)


@pytest.mark.parametrize("policy", ["drop", "reweight"])
def test_no_trained_group_lags_more_than_the_bound_unless_reweighted(policy):
    """Long generations finish out of order, so a group may meet a trainer further ahead than
    admission foresaw: it is dropped, or trained with a weight below 1, per stale_policy."""
    costs = dataclasses.replace(FREE, train_s_per_token=2e-4)
    rl = {"max_staleness": 1, "stale_policy": policy}
    result = simulate(_config(costs, LONG_TAIL, steps=300, rl=rl))
    beyond = sum(n for lag, n in result.staleness.items() if lag > 1)
    if policy == "drop":
        assert max(result.staleness) <= 1 and result.dropped_groups > 0
        assert result.reweighted_groups == 0
    else:
        assert beyond > 0 and result.reweighted_groups == beyond and result.dropped_groups == 0
    assert sum(result.staleness.values()) == 600


def test_a_long_tail_costs_the_synchronous_loop_more_than_the_asynchronous_one():
    costs = dataclasses.replace(FREE, train_s_per_token=1e-4, publish_s=0.1)

    def rate(lengths, staleness):
        cfg = _config(costs, lengths, steps=200, padded_decode=False)
        cfg = dataclasses.replace(
            cfg,
            rl=dataclasses.replace(
                cfg.rl, rollout=dataclasses.replace(cfg.rl.rollout, max_staleness=staleness)
            ),
        )
        return simulate(cfg).samples_per_s

    mean = round(float(np.mean(LONG_TAIL.draw(np.random.default_rng(0), 100_000, 2000))))
    constant = Lengths(values=(mean,))
    sync = rate(LONG_TAIL, 0) / rate(constant, 0)
    asynchronous = rate(LONG_TAIL, 2) / rate(constant, 2)
    assert sync < 0.8 * asynchronous


def test_inflight_updates_make_tokens_fresher_and_the_loop_faster():
    """Without in-flight updates a sampler finishes its generations on the old weights, admitting
    nothing meanwhile: its tokens lag the trainer more and its slots idle."""
    costs = dataclasses.replace(FREE, train_s_per_token=2e-4, publish_s=0.1, rebuild_s=0.05)
    on, off = (
        simulate(
            _config(costs, LONG_TAIL, steps=300, inflight_updates=flag, rl={"max_staleness": 2})
        )
        for flag in (True, False)
    )
    assert on.token_lag < off.token_lag
    assert on.samples_per_s > off.samples_per_s and on.slot_use > off.slot_use


def test_admission_and_training_go_through_the_schedulers_own_functions(monkeypatch):
    """The simulator has no copy of the policy: patching the scheduler's functions changes it."""
    calls = {"admits": 0, "next_groups": 0}
    admits, next_groups = scheduler.admits_group, scheduler.next_groups

    def counted_admits(*args):
        calls["admits"] += 1
        return admits(*args)

    def counted_next_groups(*args, **kwargs):
        calls["next_groups"] += 1
        return next_groups(*args, **kwargs)

    monkeypatch.setattr(scheduler, "admits_group", counted_admits)
    monkeypatch.setattr(scheduler, "next_groups", counted_next_groups)
    synchronous = _config(rl={"max_staleness": 0})
    assert simulate(synchronous).staleness == {0: 20}
    assert calls["admits"] > 0 and calls["next_groups"] >= 10

    monkeypatch.setattr(scheduler, "admits_group", lambda *args: True)  # no bound at all
    assert (
        max(
            simulate(
                dataclasses.replace(
                    synchronous,
                    rl=dataclasses.replace(
                        synchronous.rl,
                        rollout=dataclasses.replace(
                            synchronous.rl.rollout, stale_policy="reweight"
                        ),
                    ),
                )
            ).staleness
        )
        > 0
    )


def test_costs_interpolate_extrapolate_and_round_trip_through_json(tmp_path):
    costs = Costs(decode_rows=(2, 4), decode_s=(0.1, 0.2))
    assert costs.decode_step_s(1) == pytest.approx(0.1)
    assert costs.decode_step_s(3) == pytest.approx(0.15)
    assert costs.decode_step_s(8) == pytest.approx(0.4)
    assert Costs(decode_rows=(4,), decode_s=(0.2,)).decode_step_s(8) == pytest.approx(0.4)
    for rows, seconds in (((4, 2), (0.2, 0.1)), ((2, 4), (0.0, 0.1)), ((2,), (0.1, 0.2))):
        with pytest.raises(ValueError):
            Costs(decode_rows=rows, decode_s=seconds)
    path = str(tmp_path / "costs.json")
    costs.dump(path, preset="rl_tiny")
    assert Costs.load(path) == costs


def test_lengths_from_a_file_and_lognormal_are_clipped_to_the_budget(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("3 5\n9\n")
    rng = np.random.default_rng(0)
    assert set(Lengths.from_file(str(path)).draw(rng, 200, cap=8)) == {3, 5, 8}
    drawn = np.array(Lengths(median=50, sigma=1.0).draw(rng, 20_000, cap=10_000))
    assert abs(np.median(drawn) - 50) < 2 and drawn.min() >= 1


def test_the_trainer_line_gives_seconds_per_token_and_per_step():
    assert simulate_async.fit_line({100: 1.5, 300: 2.5}) == pytest.approx((0.005, 1.0))
    assert simulate_async.fit_line({100: 1.0}) == pytest.approx((0.01, 0.0))
    assert simulate_async.fit_line({100: 2.0, 300: 1.0}) == pytest.approx((0.0, 1.0))


def test_calibration_pieces_measure_positive_costs():
    """At toy sizes: a decode step of the preset's model and one grading of a built-in task."""
    cfg = presets.rl_tiny()
    rl = dataclasses.replace(
        cfg.rl, rollout=dataclasses.replace(cfg.rl.rollout, context_len=128, prefill_buckets=(64,))
    )
    model = init_model(cfg.model, 0)
    assert simulate_async.decode_step_seconds(model, rl, rows=1, prompt_len=40, steps=1) > 0
    assert simulate_async.grading_seconds(1) > 0
