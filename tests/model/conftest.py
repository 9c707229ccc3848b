"""Shared small model for the model tests (one instantiation per session keeps them fast)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import config
from composer_jax.model.transformer import Transformer, init_model
from tests.helpers import tiny_model_config


def model_config(**kw) -> config.ModelConfig:
    """Tiny preset with stacks of two dense and two MoE layers, two MTP depths, float32 compute."""
    base = dict(
        replay_min_ratio=0.0,  # plain replay: forced experts are kept (test_replay checks the filter)
        num_layers=4,
        first_k_dense=2,
        num_mtp_layers=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
    )
    return tiny_model_config(**{**base, **kw})


def randomize_buffers(m: Transformer, seed: int = 0) -> None:
    """Non-trivial norm scales and expert biases, so missing ones would show in the outputs."""
    rng = np.random.default_rng(seed)
    for _, v in nnx.iter_graph(m):
        if (
            isinstance(v, nnx.Param)
            and v.get_metadata().get("logical_axes", ())[-1:]
            in (("embed",), ("q_lora",), ("kv_lora",))
            and len(v.get_metadata()["logical_axes"]) == 1
        ):
            v[...] = jnp.asarray(rng.uniform(0.5, 1.5, v.shape), v[...].dtype)
    if m.moe_layers is not None:
        bias = m.moe_layers.mlp.expert_bias
        bias[...] = jnp.asarray(rng.uniform(-0.3, 0.3, bias.shape), jnp.float32)


@pytest.fixture(scope="session")
def model_and_cfg():
    cfg = model_config()
    m = init_model(cfg, seed=0)
    randomize_buffers(m)
    return m, cfg
