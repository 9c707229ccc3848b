"""The actor loop's timeline: a real rollout and RL step traced into valid Chrome trace events,
with the summary's numbers recomputed here from the events; tracing off records nothing."""

import dataclasses
import json
import os

import pytest

from composer_jax import config, data, envs, presets, trace
from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.sampler import LocalSampler
from composer_jax.actor.samples import groups_to_batch
from composer_jax.actor.thread_pool import ThreadEnvironmentPool
from composer_jax.actor.trainer import RLTrainer
from composer_jax.config import ConfigError, RLConfig, RolloutConfig
from composer_jax.model import init_model
from composer_jax.train.step import split_model
from tests.actor.scripted import ScriptedSampler, make_coordinator

TOKENIZER = data.get_tokenizer("byte")
CONTEXT = 384  # a tiny task's prompt (<= ~310 bytes) plus one short turn


def _rollout(cfg, sampler, pool, ledger, tracer):
    task = envs.builtin_tasks(1, seed=3, max_ops=1)[0]
    coordinator = make_coordinator(cfg, sampler, pool, ledger, [("p0", task)], tracer=tracer)
    coordinator.start()
    try:
        assert coordinator.wait_for_groups(1, timeout_s=300) == ["p0"]
    finally:
        coordinator.stop()


def _merged_seconds(spans):
    """Busy time as the test sees it: merge overlapping [start, end) spans, sum the merged."""
    merged = []
    for start, end in sorted((e["ts"], e["ts"] + e["dur"]) for e in spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return sum(end - start for start, end in merged) / 1e6


def test_a_traced_rollout_and_step_give_role_tracks_and_a_consistent_summary(tmp_path):
    cfg = dataclasses.replace(presets.rl_tiny(), workdir=str(tmp_path / "run"))
    rl = dataclasses.replace(
        cfg.rl,
        rollout=dataclasses.replace(
            cfg.rl.rollout,
            group_size=2,
            groups_per_step=1,
            num_slots=2,
            context_len=CONTEXT,
            max_new_tokens=8,
        ),
        agent=dataclasses.replace(cfg.rl.agent, max_turns=1, feedback_detectors=()),
    )
    model = init_model(cfg.model, 0)
    _, params, buffers = split_model(model)
    store = str(tmp_path / "weights")
    path = str(tmp_path / "out" / "t.json")
    tracer = trace.make_tracer(path)
    tracer.name_thread(trace.TRAINER)
    trainer = RLTrainer(cfg, params, buffers, store, tracer=tracer)
    tracer.start()
    trainer.publish().result()
    sampler = LocalSampler(
        model, store, num_slots=2, max_len=CONTEXT, prefill_buckets=(CONTEXT,), tracer=tracer
    )
    ledger = GroupLedger(tmp_path / "ledger")
    with ThreadEnvironmentPool(2, timeout_s=60) as pool:
        pool.tracer = tracer
        _rollout(rl, sampler, pool, ledger, tracer)
        batch = groups_to_batch([ledger.load("p0")], CONTEXT, row_multiple=trainer.data_parallel)
        with tracer.span("pack"):  # what run_rl records around groups_to_batch
            pass
        trainer.step(batch)
        trainer.last_publish.result()
        trainer.close()
    summary = tracer.write(path)

    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert {"name", "cat", "ts", "dur", "pid", "tid", "args"} <= set(e) and e["dur"] >= 0
    by_track = {}
    for e in spans:
        by_track.setdefault(tracks[e["tid"]], set()).add(e["cat"])
    assert {"decode", "prefill", "emit", "rollout_host", "weight_reload"} <= by_track["sampler"]
    assert {"reference", "train_step", "publish_dispatch", "pack"} <= by_track["trainer"]
    assert by_track["weight publish"] == {"publish"}
    env_tracks = [t for t in by_track if t.startswith("env thread")]
    assert env_tracks and all(by_track[t] == {"env"} for t in env_tracks)
    assert "compile" in set().union(*by_track.values())  # the first decode and step are traced
    # Spans of one track nest (what a trace viewer needs); 1 ms of slack for JAX's wall clock.
    for tid in tracks:
        open_ends = []
        for e in sorted((e for e in spans if e["tid"] == tid), key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"] + 1e-3:  # a ns: float microseconds
                open_ends.pop()
            assert not open_ends or e["ts"] + e["dur"] <= open_ends[-1] + 1e3, e
            open_ends.append(e["ts"] + e["dur"])

    wall = doc["otherData"]["wall_s"]
    assert summary["wall_s"] == pytest.approx(wall)
    for role in (trace.SAMPLER, trace.TRAINER):
        mine = [e for e in spans if tracks[e["tid"]] == role and e["cat"] in trace.BUSY[role]]
        assert summary["busy"][role] == pytest.approx(_merged_seconds(mine) / wall, abs=1e-9)
        assert 0 < summary["busy"][role] <= 1
    decodes = [e for e in spans if e["cat"] == "decode"]
    assert summary["decode_steps"] == len(decodes) > 0
    assert summary["decoded_tokens"] == sum(e["args"]["tokens"] for e in decodes)
    assert summary["categories"]["trainer/train_step"]["count"] == 1
    host = [
        e for e in spans if tracks[e["tid"]] == "sampler" and e["cat"] in ("emit", "rollout_host")
    ]
    assert summary["host_ms_per_token"] == pytest.approx(
        sum(e["dur"] for e in host) / 1e3 / summary["decoded_tokens"]
    )
    with open(trace.summary_path(path)) as f:
        assert f.read().strip() == trace.format_summary(summary)


def test_spans_are_closed_when_the_block_raises():
    with trace.Tracer() as tracer:
        with pytest.raises(ValueError), tracer.span("train_step"):
            raise ValueError("boom")
    [event] = [e for e in tracer.events() if e["ph"] == "X"]
    assert event["cat"] == "train_step" and event["dur"] >= 0


def test_tracing_off_is_one_shared_no_op_and_writes_nothing(tmp_path):
    tracer = trace.make_tracer("")
    assert tracer is trace.NULL_TRACER and not tracer.enabled
    assert tracer.span("decode", running=3) is tracer.span("env")
    task = envs.builtin_tasks(1, seed=3, max_ops=1)[0]
    turns = envs.oracle_turns(task)
    sampler = ScriptedSampler(lambda prompt, turn: turns[turn], TOKENIZER, k=2)
    with ThreadEnvironmentPool(2, timeout_s=60) as pool:
        _rollout(
            RLConfig(rollout=RolloutConfig(group_size=2, groups_per_step=1)),
            sampler,
            pool,
            GroupLedger(tmp_path / "ledger"),
            tracer,
        )
    assert os.listdir(tmp_path) == ["ledger"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"trace": "t.txt"}, "local .json file"),
        ({"trace": "gs://bucket/t.json"}, "local .json file"),
        ({"trace": "t.json", "rollout": RolloutConfig(backend="ray")}, "threads backend"),
    ],
)
def test_trace_paths_are_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.validate_rl(RLConfig(**overrides))
    config.validate_rl(RLConfig(trace="runs/t.json"))
