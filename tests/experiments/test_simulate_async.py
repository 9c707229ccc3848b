"""The actor-loop simulator against cases with known answers, its use of the scheduler's own
policy, and the cheap pieces of its calibration."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from composer_jax import presets
from composer_jax.actor import scheduler
from composer_jax.actor.simulation import Costs, Lengths, SimConfig, Workload, simulate
from composer_jax.config import RLConfig, RolloutConfig
from composer_jax.model import init_model
from experiments import loop_calibration, simulate_async

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
    assert loop_calibration.fit_line({100: 1.5, 300: 2.5}) == pytest.approx((0.005, 1.0))
    assert loop_calibration.fit_line({100: 1.0}) == pytest.approx((0.01, 0.0))
    assert loop_calibration.fit_line({100: 2.0, 300: 1.0}) == pytest.approx((0.0, 1.0))


def test_calibration_pieces_measure_positive_costs():
    """At toy sizes: a decode step of the preset's model and one grading of a built-in task."""
    cfg = presets.rl_tiny()
    rl = dataclasses.replace(
        cfg.rl, rollout=dataclasses.replace(cfg.rl.rollout, context_len=128, prefill_buckets=(64,))
    )
    model = init_model(cfg.model, 0)
    assert loop_calibration.decode_step_seconds(model, rl, rows=1, prompt_len=40, steps=1) > 0
    assert loop_calibration.grading_seconds(1) > 0


def test_one_off_start_up_costs_shift_every_synchronous_step():
    """The trainer's first step and the sampler's first decode compile: in the synchronous loop
    each later step ends exactly that much later, and the throughput after step 1 is unchanged."""
    costs = dataclasses.replace(FREE, train_s_per_token=1e-3)
    base = simulate(_config(costs, rl={"max_staleness": 0}))
    slow = dataclasses.replace(costs, train_first_s=5.0, sampler_first_s=2.0)
    started = simulate(_config(slow, rl={"max_staleness": 0}))
    assert np.allclose(np.subtract(started.step_ends, base.step_ends), 7.0)
    assert started.samples_per_s_after(1) == pytest.approx(base.samples_per_s_after(1))
    assert base.samples_per_s_after(1) == pytest.approx(
        8 * 9 / (base.step_ends[-1] - base.step_ends[0])
    )
    with pytest.raises(ValueError, match="must be in 1..9"):
        base.samples_per_s_after(10)


def test_dynamic_sampling_drops_uniform_groups_through_the_scheduler():
    """A share of the groups get equal rewards: with skip_uniform_groups next_groups drops them
    (the trainer waits for more), without it they train like the rest."""
    work = {"uniform_fraction": 0.5}
    skip = simulate(_config(steps=200, workload=work, rl={"skip_uniform_groups": True}))
    keep = simulate(_config(steps=200, workload=work, rl={"skip_uniform_groups": False}))
    assert keep.uninformative_groups == 0 and skip.trained_samples == keep.trained_samples
    share = skip.uninformative_groups / (skip.uninformative_groups + 400)
    assert 0.4 < share < 0.6
    assert skip.samples_per_s == pytest.approx(keep.samples_per_s / 2, rel=0.15)
    assert skip.generated_samples >= 4 * (400 + skip.uninformative_groups)


def test_sample_tokens_split_a_packed_group_into_generated_and_other_tokens():
    """Two samples; the first has two sequences (a summary restarts it), the second one."""
    mask = [0, 0, 1, 1, 1] + [0, 1] + [0, 0, 0, 1, 1] + [0, 0]  # the last two: padding
    arrays = {
        "sequence_lengths": np.array([5, 2, 5]),
        "sequence_sample": np.array([0, 0, 1]),
        "policy_mask": np.array(mask, bool),
    }
    generated, other = simulate_async.sample_tokens(arrays)
    assert generated.tolist() == [4, 2] and other.tolist() == [3, 3]


def test_validation_compares_throughput_and_staleness_within_their_bounds():
    assert simulate_async.total_variation({0: 2, 1: 2}, {0: 1, 1: 3}) == pytest.approx(0.25)
    assert simulate_async.total_variation({0: 5}, {1: 7}) == pytest.approx(1.0)
    measured = {"samples_per_s": 10.0, "staleness": {0: 10, 1: 10}}
    close = simulate_async.compare(measured, {"samples_per_s": 11.0, "staleness": {0: 12, 1: 8}})
    assert close["ok"] and close["throughput_error"] == pytest.approx(0.1)
    slow = simulate_async.compare(measured, {"samples_per_s": 8.0, "staleness": {0: 1, 1: 1}})
    assert not slow["ok"]
    skewed = simulate_async.compare(measured, {"samples_per_s": 10.0, "staleness": {0: 1}})
    assert not skewed["ok"] and skewed["staleness_tvd"] == pytest.approx(0.5)


def test_a_shared_machine_slows_each_role_only_while_the_other_runs():
    """Synchronous: trainer and sampler never overlap, so the slowdowns change nothing;
    asynchronous: each one costs time."""
    costs = dataclasses.replace(FREE, train_s_per_token=1e-3)
    shared = dataclasses.replace(costs, decode_train_s=0.03, train_slowdown=3.0)
    sync = {"max_staleness": 0}
    assert simulate(_config(shared, rl=sync)).step_ends == pytest.approx(
        simulate(_config(costs, rl=sync)).step_ends
    )
    fast = simulate(_config(costs, LONG_TAIL, steps=100))
    for slowdown in ({"decode_train_s": 0.03}, {"train_slowdown": 3.0}):
        slow = simulate(_config(dataclasses.replace(costs, **slowdown), LONG_TAIL, steps=100))
        assert slow.seconds > 1.1 * fast.seconds


def test_a_pool_of_environment_workers_queues_the_gradings():
    """Constant lengths: a step's 8 samples end together; one worker grades them one after
    another (8 s), unlimited workers at once (1 s)."""
    costs = dataclasses.replace(FREE, grading_s=1.0)
    sync = {"max_staleness": 0}
    pooled = simulate(_config(costs, rl=sync, env_workers=1))
    unlimited = simulate(_config(costs, rl=sync))
    assert pooled.seconds - unlimited.seconds == pytest.approx(10 * 7.0)


def _span(tid, category, start_ms, dur_ms, name="", **args):
    return {
        "ph": "X",
        "pid": 1,
        "tid": tid,
        "cat": category,
        "name": name or category,
        "ts": start_ms * 1e3,
        "dur": dur_ms * 1e3,
        "args": args,
    }


def test_costs_read_off_a_trace_of_the_loop(tmp_path):
    """A synthetic trace. Sampler: two decode calls alone (10 ms), one beside an environment
    call (14 ms), each followed by 2 ms of emit, one that compiles (left out), two during a
    train step (1 s). Trainer: steps of pack + reference + train_step: the first compiles, the
    second runs alone (1 s), the third beside decoding (3 s). Environment: a start (5 ms), a
    grading alone (100 ms), one beside training (150 ms), a close (14 ms)."""
    names = {1: "sampler", 2: "trainer", 3: "weight publish", 4: "env worker 0"}
    events = [
        {"ph": "M", "pid": 1, "tid": t, "name": "thread_name", "args": {"name": n}}
        for t, n in names.items()
    ]
    events += [_span(1, "decode", t, d, running=4) for t, d in ((0, 10), (20, 10), (40, 14))]
    events += [_span(1, "emit", t, 2) for t in (10, 30, 54)]
    events += [_span(1, "compile", 5000, 2000), _span(1, "decode", 5000, 2500)]
    events += [_span(2, "compile", 100, 5000)]
    steps = ((100, (100, 100, 9800)), (20000, (100, 200, 700)), (30000, (300, 300, 2400)))
    for start, parts in steps:
        for category, dur in zip(("pack", "reference", "train_step"), parts):
            events.append(_span(2, category, start, dur, rows=32))
            start += dur
    events += [_span(1, "decode", 30000 + i * 1000, 1000) for i in range(2)]
    events += [_span(1, "prefill", 50000, 50, rows=2), _span(3, "publish", 60000, 200)]
    events += [_span(1, "weight_reload", 61000, 20), _span(4, "env", 62000, 5, "start")]
    events += [_span(4, "env", 62100, 100, "step"), _span(4, "env", 32500, 150, "step")]
    events += [_span(4, "env", 40, 14, "close")]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    cfg = presets.rl_tiny()
    costs = loop_calibration.costs_from_traces([str(path)], cfg, prompt_tokens=100, samples=2)
    rollout = cfg.rl.rollout
    assert costs.decode_rows == (rollout.num_slots,)
    assert costs.decode_s == pytest.approx((0.010 + 0.006 / 5,))  # the emits spread over calls
    assert (costs.decode_train_s, costs.decode_env_s) == pytest.approx((0.99, 0.004))
    tokens = rollout.groups_per_step * rollout.group_size * rollout.context_len
    assert costs.train_s_per_token == pytest.approx(1.0 / tokens)
    assert costs.train_slowdown == pytest.approx(3.0)
    assert costs.prefill_s_per_token == pytest.approx(0.05 / 200)
    assert (costs.publish_s, costs.rebuild_s) == pytest.approx((0.2, 0.02))
    assert costs.grading_s == pytest.approx(2 * 0.1 / 2)
    assert (costs.env_start_s, costs.env_close_s) == pytest.approx((0.005, 0.014))
    assert costs.env_slowdown == pytest.approx(1.5)
    assert (costs.train_first_s, costs.sampler_first_s) == pytest.approx((5.0, 2.0))


def test_a_trainer_bound_loop_keeps_its_trainer_busy_once_the_pipeline_is_full():
    """A step trains 8 x 150 tokens in 6 s, a batch generates in 50 decode steps (1.5 s): the
    trainer idles only during the first batch's generation (the fill)."""
    costs = dataclasses.replace(FREE, train_s_per_token=0.005)
    result = simulate(_config(costs, steps=20, rl={"max_staleness": 4}))
    assert result.trainer_busy_after(2) == pytest.approx(1.0)
    assert result.trainer_busy == pytest.approx(20 * 6.0 / (20 * 6.0 + 1.5))


RECORD = pathlib.Path(simulate_async.__file__).parent / "configs" / "async_validation.json"


def test_the_simulator_predicts_the_recorded_real_runs_within_their_bounds():
    """The real runs of `simulate_async --validate` (the main job's loop three ways on 2 cores:
    costs, workloads and measurements in experiments/configs/async_validation.json) predicted
    again by the simulator as it is now: samples/s within 15%, staleness within TVD 0.15."""
    record = simulate_async.read_validation(str(RECORD))
    assert set(record["settings"]) == set(simulate_async.SETTINGS)
    for name, row in simulate_async.repredict(record, seeds=16).items():
        assert row["ok"], (name, row["throughput_error"], row["staleness_tvd"])


def test_a_prediction_that_misses_fails_the_validation(capsys):
    """The same record with one run measured twice as fast: its row misses, the table says so
    and the validation's verdict is False (--validate then exits 1)."""
    record = simulate_async.read_validation(str(RECORD))
    record["settings"]["sync"]["measured"]["samples_per_s"] *= 2
    for name, row in simulate_async.repredict(record, seeds=4).items():
        record["settings"][name].update(row)
    assert not record["settings"]["sync"]["ok"]
    assert simulate_async.print_validation(record) is False
    assert "| NO" in capsys.readouterr().out
