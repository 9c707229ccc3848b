"""The decode step's plan against a real sharded sampler (an `InferenceEngine` on 8 simulated
devices holding the same weights and cache) and its compiled decode step."""

import jax
import numpy as np
from flax import nnx

from composer_jax import config as config_lib
from composer_jax import presets
from composer_jax.infer.decode import decode_chunk
from composer_jax.infer.engine import InferenceEngine
from composer_jax.model import Transformer
from composer_jax.parallel import hlo, make_layout
from composer_jax.parallel.mesh import use_layout
from composer_jax.plan import decode, devices
from tests.plan.helpers import device0_bytes


def test_the_decode_plan_is_what_a_sharded_sampler_holds_and_exchanges():
    cfg = presets.tiny()
    layout = make_layout(config_lib.MeshConfig(fsdp=4, cp=2), jax.devices()[:8])
    plan = decode.plan_decode_step(cfg, layout, slots=8, max_len=64)
    serving = decode.serving_layout(layout, cfg.model.num_experts)
    assert plan.mesh == {"replica": 1, "fsdp": 8, "cp": 1}

    _, abstract = decode.abstract_model_state(cfg, serving)  # the layout the plan compiles on
    engine = InferenceEngine(
        Transformer(cfg.model, nnx.Rngs(0)),
        num_slots=8,
        max_len=64,
        mesh=serving.mesh,
        param_shardings=jax.tree.map(lambda x: x.sharding, abstract),
        trace_context=lambda: use_layout(serving),
    )
    assert plan.params_bytes == device0_bytes(engine.state) > 0
    assert plan.cache_bytes == device0_bytes(engine.cache) > 0
    # Experts are split over the devices: each holds an eighth of the routed weights.
    expert = engine.state["moe_layers"]["mlp"]["gate"].get_value()
    assert expert.addressable_shards[0].data.shape[1] * 8 == expert.shape[1]

    inputs = decode.abstract_inputs(serving, 8)
    real_inputs = jax.tree.map(
        lambda s: jax.device_put(np.zeros(s.shape, s.dtype), s.sharding), inputs
    )
    with use_layout(serving):
        compiled = decode_chunk.lower(
            engine.graphdef, engine.state, engine.cache, real_inputs, 1, True, engine.max_len
        ).compile()
    real = hlo.analyze(compiled.as_text())
    assert plan.collective_bytes == real.bytes_by_kind()
    assert plan.flops == real.dot_flops > 0
    assert "all-to-all" in plan.collective_bytes  # tokens travel to their experts

    text = decode.render(plan, devices.by_name("H200"))
    for needle in ("decode step, 8 slots x 64 tokens", "latent cache", "tokens/s", "HBM"):
        assert needle in text


def test_the_serving_layout_keeps_the_experts_divisible_and_drops_no_token():
    """cp goes into fsdp, or into replica when fsdp x cp would not divide the experts; the
    training layout's expert capacity bound is lifted (a decode step drops no token)."""
    mesh = config_lib.MeshConfig(fsdp=2, cp=4, ep=("fsdp",), ep_capacity=1.25)
    layout = make_layout(mesh, jax.devices()[:8])
    assert layout.ep_capacity == 1.25
    for experts, shape in (
        (8, {"replica": 1, "fsdp": 8, "cp": 1}),
        (6, {"replica": 4, "fsdp": 2, "cp": 1}),
    ):
        serving = decode.serving_layout(layout, experts)
        assert dict(serving.mesh.shape) == shape and serving.ep_capacity is None
