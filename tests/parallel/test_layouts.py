"""Every (replica, fsdp, cp) layout with expert parallelism computes the single-device step."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax import config as config_lib
from composer_jax import presets
from composer_jax.config import MeshConfig
from composer_jax.model import Transformer, init_model
from composer_jax.model.layers import compute_weight, logical_axes_of
from composer_jax.model.transformer import forward
from composer_jax.parallel import make_layout, report, use_layout
from composer_jax.parallel import mesh as mesh_lib
from composer_jax.train import loop
from composer_jax.train import step as S
from tests.train.helpers import small_model_config
from tests.train.test_step import _packed_batch

LAYOUTS = [(1, 8, 1), (2, 4, 1), (1, 4, 2), (2, 2, 2)]


def _model_cfg(dtype):
    return small_model_config(num_layers=3, n_group=2, topk_group=2, dtype=dtype)


@pytest.fixture(scope="module")
def batch():
    return _packed_batch(np.random.default_rng(0), B=8, T=16)


def _loss_grads_logits(cfg, layout, batch):
    """Loss, parameter gradients, main logits and MTP hidden states of one step."""
    m = init_model(cfg, seed=5)
    graphdef, params, buffers = S.split_model(m)
    train_cfg = config_lib.TrainConfig()

    def f(params, buffers, batch):
        model = nnx.merge(graphdef, params, buffers)
        with use_layout(layout):
            loss, _ = S.pretrain_loss(model, batch, train_cfg)
            out = forward(model, batch["tokens"], batch["positions"], batch["segment_ids"])
        return loss, (model.logits(out.hidden_BTD), out.mtp_hidden_DBTD)

    grad_fn = jax.value_and_grad(f, has_aux=True)
    if layout is None:
        (loss, (logits, mtp)), grads = jax.jit(grad_fn)(params, buffers, batch)
    else:
        param_sh = layout.tree_shardings(logical_axes_of(params), params)
        buffer_sh = layout.tree_shardings(logical_axes_of(buffers), buffers)
        batch_sh = {k: layout.batch_sharding() for k in batch}
        args = jax.device_put((params, buffers, batch), (param_sh, buffer_sh, batch_sh))
        (loss, (logits, mtp)), grads = jax.jit(grad_fn)(*args)
        sharded = [g for g in jax.tree.leaves(args[0]) if not g.sharding.is_fully_replicated]
        assert sharded, "the layout sharded no parameter"
    to_np = lambda t: jax.tree.map(lambda a: np.asarray(a, np.float64), t)
    return float(loss), to_np(grads), to_np(logits), to_np(mtp)


def _rel(a, b):
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.fixture(scope="module")
def single_device(batch):
    cache = {}

    def get(dtype):
        if dtype not in cache:
            cache[dtype] = _loss_grads_logits(_model_cfg(dtype), None, batch)
        return cache[dtype]

    return get


CASES = [
    pytest.param("float32", 1e-5, layout, id="float32-{}x{}x{}".format(*layout))
    for layout in LAYOUTS
] + [
    pytest.param(
        "bfloat16",
        2e-2,
        layout,
        id="bfloat16-{}x{}x{}".format(*layout),
        marks=() if layout == (2, 2, 2) else pytest.mark.slow,
    )
    for layout in LAYOUTS
]


def test_blockwise_attention_under_context_parallelism_matches_single_device(batch, single_device):
    """The key-block attention with the queries split over cp (2 x 2 x 2) gives the dense
    single-device step: loss, every gradient, logits and MTP states."""
    want_loss, want_grads, want_logits, want_mtp = single_device("float32")
    layout = make_layout(config_lib.MeshConfig(replica=2, fsdp=2, cp=2))
    cfg = dataclasses.replace(_model_cfg("float32"), attention_block_size=6)
    loss, grads, logits, mtp = _loss_grads_logits(cfg, layout, batch)
    assert abs(loss - want_loss) / abs(want_loss) < 1e-5
    errors = jax.tree.map(_rel, grads, want_grads)
    assert max(jax.tree.leaves(errors)) < 1e-5, errors
    assert _rel(logits, want_logits) < 1e-5 and _rel(mtp, want_mtp) < 1e-5


@pytest.mark.parametrize("dtype, tol, shape", CASES)
def test_layout_matches_single_device(batch, single_device, dtype, tol, shape):
    """Loss, every gradient, logits and MTP states equal one device's (relative error < tol)."""
    replica, fsdp, cp = shape
    want_loss, want_grads, want_logits, want_mtp = single_device(dtype)
    layout = make_layout(config_lib.MeshConfig(replica=replica, fsdp=fsdp, cp=cp))
    assert layout.ep_size == fsdp * cp
    loss, grads, logits, mtp = _loss_grads_logits(_model_cfg(dtype), layout, batch)
    assert abs(loss - want_loss) / abs(want_loss) < tol
    errors = jax.tree.map(_rel, grads, want_grads)
    assert max(jax.tree.leaves(errors)) < tol, errors
    assert _rel(logits, want_logits) < tol
    assert _rel(mtp, want_mtp) < tol


def test_train_step_state_is_sharded_not_replicated():
    """The compiled step's per-device inputs are a fraction of the state: no accidental full
    replication; EP exchanges tokens with all-to-all and FSDP gathers parameters."""
    cfg = config_lib.ExperimentConfig(
        model=_model_cfg("float32"),
        mesh=config_lib.MeshConfig(replica=2, fsdp=2, cp=2),
        train=config_lib.TrainConfig(phases=(config_lib.PhaseConfig(seq_len=16, batch_size=8),)),
    )
    setup = loop.make_train_setup(cfg)
    layout = setup.layout
    tokens = jax.ShapeDtypeStruct((8, 16), np.int32, sharding=layout.batch_sharding())
    batch_spec = {"tokens": tokens, "segment_ids": tokens, "positions": tokens}
    step_fn = setup.jit_train_step(donate=False)
    compiled = step_fn.trace(setup.abstract_state, batch_spec).lower().compile()
    full_state = sum(
        int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(setup.abstract_state)
    )
    per_device = compiled.memory_analysis().argument_size_in_bytes
    assert per_device < 0.35 * full_state, (per_device, full_state)
    assert report.bytes_per_device(setup.abstract_state.params) < 0.35 * sum(
        int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(setup.abstract_state.params)
    )
    comms = report.collective_bytes(compiled.as_text())
    assert comms.get("all-to-all", 0) > 0 and comms.get("all-gather", 0) > 0, comms
    table = report.sharding_table(setup.abstract_state.params)
    assert "moe_layers.mlp.gate" in table and "('fsdp', 'cp')" in table


def test_mxfp8_dispatch_stays_close(batch, single_device):
    """Tokens sent to their experts in MXFP8 (results back in the compute dtype): close to the
    exact step, and the gradient still reaches every parameter."""
    want_loss, want_grads, want_logits, _ = single_device("float32")
    mesh_cfg = config_lib.MeshConfig(replica=1, fsdp=4, cp=2, ep_quantize="mxfp8")
    layout = make_layout(mesh_cfg)
    assert layout.quantize_dispatch
    loss, grads, logits, _ = _loss_grads_logits(_model_cfg("float32"), layout, batch)
    loss_err, logits_err = abs(loss - want_loss) / abs(want_loss), _rel(logits, want_logits)
    grad_err = max(jax.tree.leaves(jax.tree.map(_rel, grads, want_grads)))
    print(
        f"\nMXFP8 dispatch relative error: loss {loss_err:.1e}, logits {logits_err:.1e}, "
        f"worst gradient {grad_err:.1e}"
    )
    assert 0 < logits_err < 3e-2 and loss_err < 1e-2 and grad_err < 0.2


@pytest.mark.parametrize("quantize", ["none", "mxfp8"])
def test_ragged_dispatch_bookkeeping(batch, single_device, quantize):
    """The ragged exchange's offsets and sizes, moved by an all-gather stand-in for
    `ragged_all_to_all` (which XLA:CPU cannot run), reproduce the single-device step."""
    want_loss, want_grads, want_logits, _ = single_device("float32")
    mesh_cfg = config_lib.MeshConfig(
        replica=2, fsdp=2, cp=2, ep_dispatch="ragged_emulated", ep_quantize=quantize
    )
    loss, grads, logits, _ = _loss_grads_logits(_model_cfg("float32"), make_layout(mesh_cfg), batch)
    tol = 1e-5 if quantize == "none" else 3e-2
    assert abs(loss - want_loss) / abs(want_loss) < tol
    assert _rel(logits, want_logits) < tol
    assert max(jax.tree.leaves(jax.tree.map(_rel, grads, want_grads))) < tol * 7


@pytest.mark.parametrize("capacity", [None, 1.25])
def test_ragged_dispatch_lowers_for_gpu(batch, capacity):
    """The real `ragged_all_to_all` path, dropless and bounded, lowers for CUDA (it cannot run
    on XLA:CPU)."""
    mesh = config_lib.MeshConfig(fsdp=4, cp=2, ep_dispatch="ragged", ep_capacity=capacity)
    layout = make_layout(mesh)
    m = init_model(_model_cfg("bfloat16"), seed=5)
    graphdef, params, buffers = S.split_model(m)

    def loss(params, batch):
        with use_layout(layout):
            return S.pretrain_loss(
                nnx.merge(graphdef, params, buffers), batch, config_lib.TrainConfig()
            )[0]

    lowered = jax.jit(jax.grad(loss)).trace(params, batch).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "ragged_all_to_all" in text or "ragged-all-to-all" in text


def test_a_weight_is_cast_where_it_is_stored():
    """`compute_weight` under a layout gives the cast copy the parameter's own sharding (so no
    device needs a gathered float32 copy); without a layout it is the plain cast."""
    layout = make_layout(config_lib.MeshConfig(replica=2, fsdp=2, cp=2))
    sharding = layout.sharding(("embed", "mlp"), (16, 24))
    value = np.random.default_rng(0).normal(size=(16, 24)).astype(np.float32)

    def cast(value, under_layout=True):
        w = nnx.Param(value, logical_axes=("embed", "mlp"))
        with use_layout(layout if under_layout else None):
            return compute_weight(w, jax.numpy.bfloat16)

    replicated = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
    out = jax.jit(cast)(jax.device_put(value, replicated))  # the cast itself is what shards
    assert out.dtype == jax.numpy.bfloat16 and out.sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_array_equal(np.asarray(out), value.astype(out.dtype))
    plain = cast(value, under_layout=False)
    np.testing.assert_array_equal(np.asarray(plain), value.astype(jax.numpy.bfloat16))


def test_committed_alike_commits_the_rest_only_where_the_committed_share_one_device():
    zeros = jax.numpy.zeros(())
    assert not zeros.committed
    on_one = mesh_lib.committed_alike(
        {"w": jax.device_put(np.ones(3), jax.devices()[1]), "n": zeros}
    )
    assert on_one["n"].committed and on_one["n"].devices() == {jax.devices()[1]}
    spread = {
        "w": jax.device_put(np.ones(3), jax.devices()[0]),
        "v": jax.device_put(np.ones(3), jax.devices()[1]),
        "n": zeros,
    }
    assert mesh_lib.committed_alike(spread)["n"] is zeros
    assert mesh_lib.committed_alike({"n": zeros})["n"] is zeros
    traced = jax.jit(lambda w: mesh_lib.committed_alike({"w": w, "n": jax.numpy.zeros(())}))
    assert traced(on_one["w"])["n"].committed  # jit's own rule: a committed input commits all


def test_committed_mesh_is_the_one_mesh_of_the_weights_committed_across_devices():
    eight = mesh_lib.make_mesh(MeshConfig(), jax.devices()[:8])
    four = mesh_lib.make_mesh(MeshConfig(), jax.devices()[:4])
    sharded = jax.device_put(np.ones(8), NamedSharding(eight, P("fsdp")))
    uncommitted = jax.numpy.zeros(())
    one_device = jax.device_put(np.ones(3), jax.devices()[0])
    assert mesh_lib.committed_mesh({"w": sharded, "n": uncommitted, "d": one_device}) == eight
    assert mesh_lib.committed_mesh({"n": uncommitted, "d": one_device}) is None
    elsewhere = jax.device_put(np.ones(4), NamedSharding(four, P()))
    assert mesh_lib.committed_mesh({"w": sharded, "v": elsewhere}) is None


def test_a_pinned_output_keeps_its_inputs_layout_and_compiles_once():
    """A donated state fed back in: unpinned, the output takes the weights' layout and the
    second call compiles again; pinned to the input's, it does not."""
    mesh = mesh_lib.make_mesh(MeshConfig(), jax.devices()[:8])
    replicated = NamedSharding(mesh, P())
    weights = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P(None, "fsdp")))

    def step(weights, state, sharding):
        return mesh_lib.pinned(state + weights, sharding)

    jitted = jax.jit(step, static_argnums=2, donate_argnums=1)
    for sharding, compiles in ((None, 2), (replicated, 1)):
        before = jitted._cache_size()
        state = jax.device_put(np.zeros((8, 8), np.float32), replicated)
        for _ in range(3):
            state = jitted(weights, state, sharding)
        assert jitted._cache_size() - before == compiles
        np.testing.assert_array_equal(np.asarray(state), 3.0)


def test_a_dimension_the_whole_rule_does_not_divide_takes_the_axes_that_do():
    """Kimi K2's MLA up-projections on fsdp 64 x cp 16 (1,024 devices): q_lora 1536, kv_lora 512
    and 64 heads divide by 64 and by 16, not by 1,024. Each dimension takes the axes that divide
    it (the rest stay free for the next) instead of the array replicating: 6 GiB of float32 on
    every device, so the model's bytes a device grew from 512 devices to 1,024."""
    layout = mesh_lib.Layout(jax.sharding.AbstractMesh((1, 64, 16), mesh_lib.AXES), ("fsdp",))
    q_b = ("layers", "q_lora", "heads", "head_dim")
    assert layout.spec(q_b, (60, 1536, 64, 192)) == P(None, "fsdp", "cp", None)
    assert layout.spec(("vocab", "embed"), (163840, 7168)) == P(("fsdp", "cp"), None)
    assert layout.spec(("heads",), (48,)) == P("cp")  # 48 divides by 16, not by 64
    assert layout.spec(("heads",), (7,)) == P(None)

    model_cfg = presets.kimi_k2().model
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    axes = jax.tree.leaves(logical_axes_of(params), is_leaf=lambda a: isinstance(a, tuple))

    def bytes_a_device(cp):
        layout = mesh_lib.Layout(jax.sharding.AbstractMesh((1, 64, cp), mesh_lib.AXES), ("fsdp",))
        total = 0
        for names, x in zip(axes, jax.tree.leaves(params)):
            spec = layout.spec(names, x.shape)
            split = [math.prod(layout.mesh.shape[a] for a in _axes_of(s)) for s in spec]
            total += math.prod(n // k for n, k in zip(x.shape, split)) * x.dtype.itemsize
        return total

    assert bytes_a_device(16) < 0.55 * bytes_a_device(8)


def _axes_of(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
