"""The plan of a training step against what a real run of it holds and exchanges, on 8 simulated
devices; loop trip counts in the HLO costs; the command line's errors."""

import dataclasses
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax import config as config_lib
from composer_jax import presets
from composer_jax.parallel import hlo, make_layout
from composer_jax.plan import buffers, costs, devices, training
from composer_jax.train.loop import make_train_setup
from tests.plan.helpers import device0_bytes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _plan(*args: str, **environment: str) -> subprocess.CompletedProcess:
    """`python -m launch.plan ARGS` with `environment` added to this one's."""
    return subprocess.run(
        [sys.executable, "-m", "launch.plan", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, **environment),
    )


@pytest.fixture(scope="module")
def tiny_8():
    cfg = presets.tiny()
    layout = make_layout(config_lib.MeshConfig(fsdp=4, cp=2), jax.devices()[:8])
    return cfg, layout, training.plan_training_step(cfg, layout)


def test_the_plan_is_what_a_real_run_allocates_and_exchanges(tiny_8):
    cfg, layout, plan = tiny_8
    setup = make_train_setup(cfg, layout)
    state = setup.init_state()  # allocated, as a run does
    assert plan.params_bytes == device0_bytes(state.params) > 0
    assert plan.optimizer_bytes == device0_bytes(state.opt_state) > 0
    phase = cfg.train.phases[0]
    shape = (phase.batch_size, phase.seq_len)
    tokens = jax.device_put(
        jnp.asarray(np.random.default_rng(0).integers(0, 256, shape), jnp.int32),
        layout.batch_sharding(),
    )
    batch = {
        "tokens": tokens,
        "positions": jax.device_put(
            jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape),
            layout.batch_sharding(),
        ),
        "segment_ids": jax.device_put(jnp.ones(shape, jnp.int32), layout.batch_sharding()),
    }
    compiled = setup.jit_train_step().lower(state, batch).compile()
    real = hlo.analyze(compiled.as_text())
    assert plan.collective_bytes == real.bytes_by_kind()
    assert plan.collective_count == real.count_by_kind()
    assert plan.flops == real.dot_flops > 0
    assert set(plan.collective_bytes) >= {"all-gather", "all-reduce", "all-to-all"}
    assert {"fsdp", "cp", "fsdp+cp"} <= set(plan.bytes_by_axes)  # data, context, experts
    assert plan.unknown_trip_loops == 0


def test_the_estimate_and_the_table(tiny_8):
    _, _, plan = tiny_8
    h200 = devices.by_name("H200")
    t = costs.estimate(plan, h200)
    assert t["compute_s"] == pytest.approx(plan.flops / h200.bf16_flops)
    assert t["step_s_overlapped"] == max(t["compute_s"], t["communication_s"]) > 0
    assert t["step_s_serial"] == pytest.approx(t["compute_s"] + t["communication_s"])
    assert t["fits"] == 1.0
    text = training.render(plan, h200)
    for needle in ("parameters", "optimizer state", "step peak", "all-to-all", "over fsdp+cp"):
        assert needle in text
    tiny_device = devices.DeviceSpec("tiny", 1e12, 2e12, None, 1e12, 1e11, plan.peak_bytes - 1, 1)
    assert "does NOT fit" in training.render(plan, tiny_device)


def _gathers(x, layers: int, unrolled: bool):
    """`layers` all-gathers over 8 devices, in a scan or written out."""
    mesh = jax.make_mesh((8,), ("d",))

    def body(carry, _):
        return carry + lax.all_gather(carry, "d", tiled=True)[: carry.shape[0]], None

    def run(c):
        if unrolled:
            for _ in range(layers):
                c, _ = body(c, None)
            return c
        return lax.scan(body, c, None, length=layers)[0]

    fn = jax.shard_map(run, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    sharded = jax.device_put(x, NamedSharding(mesh, P("d")))
    return hlo.analyze(jax.jit(fn).lower(sharded).compile().as_text())


def test_the_counter_on_programs_counted_by_hand():
    """hlo.analyze against numbers written out, not against itself: 2 * m * k * n FLOPs a dot
    (batched or not), and an all-gather of 8 float32 per device over 8 devices produces 256
    bytes on each."""
    a, b = jnp.ones((16, 32)), jnp.ones((32, 8))
    dot = hlo.analyze(jax.jit(lambda x, y: x @ y).lower(a, b).compile().as_text())
    assert dot.dot_flops == 2 * 16 * 32 * 8
    x, y = jnp.ones((4, 16, 32)), jnp.ones((4, 32, 8))
    batched = jax.jit(lambda p, q: jnp.einsum("bij,bjk->bik", p, q)).lower(x, y).compile()
    assert hlo.analyze(batched.as_text()).dot_flops == 2 * 4 * 16 * 32 * 8
    one = _gathers(jnp.arange(64.0), 1, unrolled=True)
    assert one.bytes_by_kind()["all-gather"] == 64 * 4


def test_communication_time_prices_each_collective_on_its_link():
    """An all-reduce of 1 GB inside an 8-GPU NVLink domain moves 2 * 7/8 GB at half the NVLink
    figure (one direction); an all-gather producing 1 GB over 16 GPUs (spanning two domains)
    moves 15/16 GB over the scale-out network; each twice per step. Written out by hand."""
    device = devices.DeviceSpec(
        "made-up", 1e15, 2e15, None, 4e12, 900e9, 141e9, 132, nvlink_domain=8,
        scale_out_bytes_per_s=50e9,
    )  # fmt: skip
    collectives = [
        hlo.Collective("all-reduce", 1e9, 2, group_size=8, group_span=8),
        hlo.Collective("all-gather", 1e9, 2, group_size=16, group_span=16),
    ]
    step = costs.CompiledCosts(
        devices=16, mesh={"fsdp": 16}, argument_bytes=0, output_bytes=0, alias_bytes=0,
        temp_bytes=0, flops=1e15, collective_bytes={}, collective_count={}, bytes_by_axes={},
        unknown_trip_loops=0, compile_seconds=0.0, collectives=collectives,
    )  # fmt: skip
    inside = 2 * 2 * (7 / 8) * 1e9 / (900e9 / 2)
    across = 2 * (15 / 16) * 1e9 / 50e9
    t = costs.estimate(step, device)
    assert t["communication_s"] == pytest.approx(inside + across)
    assert t["compute_s"] == pytest.approx(1.0)
    assert t["step_s_overlapped"] == pytest.approx(max(1.0, inside + across))


def test_a_capacity_bound_shrinks_the_planned_exchange_and_says_so(tiny_8):
    """At capacity 1 over a group of 8 the step exchanges 8x fewer bytes and holds fewer
    temporaries than the dropless (worst-case) one, and the table names the bound."""
    cfg, layout, dropless = tiny_8
    bounded_layout = dataclasses.replace(layout, ep_capacity=1.0)
    bounded = training.plan_training_step(cfg, bounded_layout)
    assert bounded.capacity == 1.0 and dropless.capacity is None
    exchanged = bounded.collective_bytes["all-to-all"], dropless.collective_bytes["all-to-all"]
    assert exchanged[0] * 8 == exchanged[1], exchanged
    assert bounded.temp_bytes < dropless.temp_bytes
    h200 = devices.by_name("H200")
    assert "worst case" in training.render(dropless, h200)
    assert "mesh.ep_capacity=1.0" in training.render(bounded, h200)


ASSIGNMENT = """BufferAssignment:
allocation 0: size 2048, page 0, parameter 0, shape |f32[8,64]| at ShapeIndex {}, maybe-live-out:
 value: <1 p.1 @0> (size=2048,offset=0): f32[8,64]{1,0}
allocation 1: size 40960, page 0, preallocated-temp:
 value: <2 gather.2 @0> (size=32768,offset=0): bf16[4,64,64]{2,1,0}
 value: <3 dot.3 @0> (size=4096,offset=0): f32[8,128]{1,0}
 value: <4 dot.4 @0> (size=4096,offset=28672): f32[8,128]{1,0}
 value: <5 add.5 @0> (size=8192,offset=32768): f32[16,128]{1,0}
"""
MODULE = """
  %p.1 = f32[8,64]{1,0} parameter(0), metadata={op_name="state.params['w']"}
  %gather.2 = bf16[4,64,64]{2,1,0} gather(%a, %b), metadata={op_name="jit(step)/transpose(jvp())/while/body/gather"}
  %dot.3 = f32[8,128]{1,0} dot(%c, %d), metadata={op_name="jit(step)/jvp()/ab,bc->ac/dot_general"}
  ROOT %dot.4 = f32[8,128]{1,0} dot(%c, %d), metadata={op_name="jit(step)/jvp()/ab,bc->ac/dot_general"}
"""


def test_the_buffers_are_the_arguments_and_the_regions_of_the_temporaries():
    """Temporaries whose byte ranges overlap share a region; the regions and the arguments add
    up to the allocations; each value is named by the operation that made it."""
    found = buffers.parse(ASSIGNMENT, MODULE)
    assert [(b.size_bytes, b.kind) for b in found] == [
        (32768, "temporaries"),
        (8192, "temporaries"),
        (2048, "argument"),
    ]
    assert found[0].values == (
        ("bf16[4,64,64]", "backward gather"),
        ("f32[8,128]", "ab,bc->ac/dot_general"),
        ("f32[8,128]", "ab,bc->ac/dot_general"),
    )
    assert found[1].values == (("f32[16,128]", "add.5"),)  # no op name: the instruction's
    assert found[2].values == (("f32[8,64]", "state.params['w']"),)
    text = buffers.render(found, 1, costs.size)
    assert "(1 of 3)" in text and "2x f32[8,128] (ab,bc->ac/dot_general)" in text


def test_the_plan_lists_what_holds_the_peak(tmp_path):
    """--buffers=N prints N allocations of the tiny step, read from XLA's dump, and leaves no
    dump behind."""
    done = _plan("--config=tiny", "--steps=train", "--buffers=3", TMPDIR=str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    listing = done.stdout.split("largest buffers of the step (3 of ")[1]
    rows = listing.splitlines()[1:4]
    assert len(rows) == 3 and all(
        re.search(r"\d+\.\d+ [KMG]iB  \w+: (\d+x )?\w+\[", row) for row in rows
    )
    assert not list(tmp_path.iterdir())


def test_a_scanned_loop_counts_each_trip_like_the_written_out_one():
    x = jnp.arange(64.0)
    scanned, written = _gathers(x, 6, unrolled=False), _gathers(x, 6, unrolled=True)
    one = _gathers(x, 1, unrolled=True)
    assert scanned.count_by_kind()["all-gather"] == 6 == written.count_by_kind()["all-gather"]
    assert scanned.bytes_by_kind() == written.bytes_by_kind()
    assert scanned.bytes_by_kind()["all-gather"] == 6 * one.bytes_by_kind()["all-gather"]
    (gather,) = [c for c in scanned.collectives if c.kind == "all-gather"]
    assert (gather.group_size, gather.group_span, gather.executions) == (8, 8, 6)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--devices=0"], "--devices: 0 cannot be simulated"),
        (["--devices=100000"], "--devices: 100000 cannot be simulated"),
        (["--config.mesh.bogus=2"], "--config.mesh.bogus: no such field"),
        (["--devices=3"], "mesh.ep"),
        (["--device=TPU9"], "--device: unknown device"),
        (["--config.mesh.fsdp=16", "--config.mesh.replica=1"], "mesh: axes"),
        (["--config.mesh.fsdp=8", "--config.mesh.cp=1"], "batch_size: 4 is not divisible"),
        (["--steps=bogus"], "--steps: unknown step 'bogus'"),
        (["--buffers=-1"], "--buffers: -1 is not a count"),
        (["--steps=decode", "--slots=3"], "--slots: 3 decode rows do not split over 8 devices"),
        (["--steps=decode", "--devices=1", "--slots=-4"], "--slots=-4: -4 is not a positive"),
    ],
)
def test_bad_plans_are_one_line_errors(args, needle):
    done = _plan("--config=tiny", *args)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], done.stderr[-2000:]


def test_the_1t_plan_prints_its_table():
    """The 1T step at the preset's layout and optimizer (MuonClip) on 128 devices compiles
    (XLA:CPU's loop-fusion emitter once crashed on it: launch.plan routes elementwise fusions
    around it) and does not fit."""
    done = _plan("--config=kimi_k2", "--devices=128", "--knobs=never")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "muon: 1,024,058,392,576 params" in done.stdout  # every matrix but the embeddings
    assert "training step, phase main (batch 512 x 32768), 128 devices" in done.stdout
    assert "(replica=1 x fsdp=64 x cp=2)" in done.stdout and "does NOT fit" in done.stdout
    assert "decode step" in done.stdout


def test_muons_split_is_printed_only_where_asked(capsys):
    """A plan prints Muon's parameter split once (launch.plan asks for it); each layout change
    it re-plans builds its setup quietly."""
    cfg = presets.tiny()
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name="muon"))
    layout = make_layout(config_lib.MeshConfig(fsdp=4, cp=2), jax.devices()[:8])
    make_train_setup(cfg, layout, verbose=False)
    assert capsys.readouterr().out == ""
    make_train_setup(cfg, layout)
    assert capsys.readouterr().out.count("muon: ") == 1


def test_the_layout_knobs_are_the_changes_that_apply_to_the_mesh():
    cfg = dataclasses.replace(presets.tiny(), mesh=config_lib.MeshConfig(replica=2, fsdp=2, cp=2))
    flags = [f for f, _ in training.layout_knobs(cfg, 8)]
    assert flags == [
        "--config.model.remat=True",
        "--config.model.attention_block_size=1024",
        f"--config.mesh.ep_capacity={config_lib.PLANNED_EXPERT_CAPACITY}",
        "--config.train.phases[0].microbatches=2",
        "--config.mesh.replica=1 --config.mesh.fsdp=4 --config.mesh.cp=2",
        "--config.mesh.replica=2 --config.mesh.fsdp=1 --config.mesh.cp=4",
        "--config.mesh.replica=2 --config.mesh.fsdp=4 --config.mesh.cp=1",
    ]
    lean = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, remat=True, attention_block_size=64),
        mesh=dataclasses.replace(cfg.mesh, ep_capacity=2.0),
    )
    first = training.layout_knobs(lean, 8, phase=1)[0][0]
    assert first == "--config.train.phases[1].microbatches=2"


def test_each_knob_is_planned_and_ranked_by_its_peak(tiny_8, monkeypatch):
    cfg, _, base = tiny_8
    unsplittable = dataclasses.replace(cfg, mesh=config_lib.MeshConfig(fsdp=8, cp=1))
    remat = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=True))
    monkeypatch.setattr(
        training, "layout_knobs", lambda c, n, p: [("fsdp=8", unsplittable), ("remat", remat)]
    )
    seen = []
    knobs = training.rank_knobs(cfg, 8, on_plan=seen.append)
    assert [k.flags for k in seen] == ["fsdp=8", "remat"]
    assert [k.flags for k in knobs] == ["remat", "fsdp=8"]  # the one that cannot plan is last
    assert knobs[0].plan.peak_bytes > 0 and knobs[0].plan.mesh == base.mesh
    assert knobs[1].plan is None and "batch_size" in knobs[1].error
    text = training.render_knobs(base, knobs, devices.by_name("H200"))
    assert "cannot plan          fsdp=8" in text and "fits; step" in text


def test_the_search_combines_the_best_change_of_each_round_until_the_step_fits(tiny_8, monkeypatch):
    """Each round keeps the change with the lowest peak (if it lowers it) and plans the next
    round from it; the search stops once the step fits, and the flags merge field by field."""
    cfg, _, base = tiny_8
    device = devices.DeviceSpec("small", 1e12, 2e12, None, 1e12, 1e11, base.peak_bytes - 1000, 1)

    def planned(flags, saved, config):
        plan = dataclasses.replace(base, temp_bytes=base.temp_bytes - saved)
        return training.Knob(flags, plan, config=config)

    rounds = {
        cfg.steps: [planned("--micro=2", 400, "micro2"), planned("--remat", 100, "remat")],
        "micro2": [planned("--micro=4", 1200, "micro4"), planned("--remat", 300, "both")],
    }
    seen = []
    monkeypatch.setattr(
        training,
        "rank_knobs",
        lambda c, n, p, on_plan: seen.append(c) or rounds[c if isinstance(c, str) else c.steps],
    )
    kept = []
    chain = training.search_knobs(cfg, base, device, 8, on_keep=kept.append)
    assert [k.flags for k in chain] == ["--micro=2", "--micro=4"] and seen[1] == "micro2"
    assert kept == chain
    assert training.combined_flags(chain + [planned("--mesh=1 --remat", 0, "")]) == (
        "--micro=4 --mesh=1 --remat"
    )
    text = training.render_search(base, chain, device)
    assert "(fits; step" in text.splitlines()[-2] and text.endswith("flags: --micro=4")
    rounds["micro2"] = [planned("--remat", -5, "worse")]  # nothing lowers the peak further
    stuck = training.search_knobs(cfg, base, device, 8)
    assert [k.flags for k in stuck] == ["--micro=2"]
    assert "plan with more devices" in training.render_search(base, stuck, device)
    roomy = dataclasses.replace(device, hbm_bytes=base.peak_bytes)
    assert training.search_knobs(cfg, base, roomy, 8) == []
    assert "fits as it is" in training.render_search(base, [], roomy)


def test_the_scanned_block_plans_the_written_out_layers():
    """The plan compiles the layer stack as one scanned block and counts its costs once per
    trip; against the same model with every layer compiled (scan_layers=False) the state, FLOPs
    and the expert and gradient exchanges are the same, while the scanned program gathers FSDP
    weights again in the backward loop (where the written-out one keeps the forward's gather
    alive), so it moves more all-gather bytes and holds fewer temporaries."""
    cfg = presets.tiny()
    layout = make_layout(config_lib.MeshConfig(fsdp=4, cp=2), jax.devices()[:8])
    plans = {}
    for scan in (True, False):
        model = dataclasses.replace(cfg.model, num_layers=4, scan_layers=scan)
        plans[scan] = training.plan_training_step(dataclasses.replace(cfg, model=model), layout)
    block, whole = plans[True], plans[False]
    assert block.params_bytes == whole.params_bytes
    assert block.optimizer_bytes == whole.optimizer_bytes
    assert block.argument_bytes == whole.argument_bytes
    assert block.flops == whole.flops > 0
    for kind in ("all-to-all", "all-reduce", "collective-permute"):
        assert block.collective_bytes[kind] == whole.collective_bytes[kind], kind
    assert block.collective_count["all-to-all"] == whole.collective_count["all-to-all"] == 15
    assert whole.collective_bytes["all-gather"] <= block.collective_bytes["all-gather"]
    assert block.collective_bytes["all-gather"] <= 1.25 * whole.collective_bytes["all-gather"]
    assert 0.75 * whole.temp_bytes <= block.temp_bytes <= whole.temp_bytes
