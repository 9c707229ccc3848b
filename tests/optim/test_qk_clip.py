"""QK-clip: after clipping, each over-threshold head's largest logit equals the threshold."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax import presets
from composer_jax.model.attention import MLA, mla_max_logits
from composer_jax.optim.qk_clip import qk_clip


def test_qk_clip_caps_max_logit_per_head():
    cfg = dataclasses.replace(presets.tiny().model, dtype="float32")
    attn = MLA(cfg, nnx.Rngs(0))
    B, T = 2, 16
    x = 3.0 * jax.random.normal(jax.random.key(1), (B, T, cfg.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    segments = jnp.ones((B, T), jnp.int32)
    before = np.asarray(mla_max_logits(attn, x, positions, segments))
    threshold = float(np.median(before))  # about half the heads get clipped
    assert (before > threshold).any() and (before <= threshold).any()
    v_before = np.asarray(attn.kv_b_proj[...][..., cfg.qk_nope_head_dim :])
    q, kv = qk_clip(
        attn.q_b_proj[...], attn.kv_b_proj[...], before, threshold, cfg.qk_nope_head_dim
    )
    attn.q_b_proj[...], attn.kv_b_proj[...] = q, kv
    after = np.asarray(mla_max_logits(attn, x, positions, segments))
    np.testing.assert_allclose(after, np.minimum(before, threshold), rtol=1e-5)
    np.testing.assert_array_equal(attn.kv_b_proj[...][..., cfg.qk_nope_head_dim :], v_before)


def test_qk_clip_on_stacked_layers_scales_each_layer_and_head():
    q = jnp.ones((3, 4, 2, 5))  # [layers, q_lora, heads, nope 3 + rope 2]
    kv = jnp.ones((3, 4, 2, 6))  # [layers, kv_lora, heads, nope 3 + v 3]
    max_logits = jnp.asarray([[1.0, 4.0], [16.0, 2.0], [0.5, 0.5]])
    q2, kv2 = qk_clip(q, kv, max_logits, 2.0, 3)
    gamma = np.asarray([[1.0, 0.5], [0.125, 1.0], [1.0, 1.0]])
    np.testing.assert_allclose(q2[:, 0, :, 0], np.sqrt(gamma))
    np.testing.assert_allclose(q2[:, 0, :, 4], gamma)
    np.testing.assert_allclose(kv2[:, 0, :, 0], np.sqrt(gamma))
    np.testing.assert_allclose(kv2[:, 0, :, 5], 1.0)
