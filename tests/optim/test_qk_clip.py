"""QK-clip: the attention's own logit maxima, and after a clipped step each over-threshold head's
largest logit equals the threshold."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composer_jax import config as config_lib
from composer_jax import presets
from composer_jax.model import init_model
from composer_jax.model.attention import MLA, mla_max_logits
from composer_jax.optim.qk_clip import QKClip, attention_params, qk_clip
from composer_jax.train.step import TrainState, split_model, train_step
from tests.train.helpers import small_model_config
from tests.train.test_step import _packed_batch


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


def _padded_packed_inputs(cfg, B=2, T=16, seed=2):
    """Row 0: two packed documents; row 1: one document then padding whose inputs are large,
    so padding queries (which attend to each other) hold the largest logits of the batch."""
    x = jax.random.normal(jax.random.key(seed), (B, T, cfg.hidden_size))
    segments = np.ones((B, T), np.int32)
    segments[0, 7:] = 2
    segments[1, 11:] = 0
    positions = np.stack([np.r_[np.arange(7), np.arange(T - 7)], np.arange(T)]).astype(np.int32)
    x = x.at[1, 11:].multiply(30.0)
    return x, jnp.asarray(positions), jnp.asarray(segments)


@pytest.mark.parametrize("block", [None, 4])
def test_attention_reports_each_heads_largest_visible_logit(block):
    """The attention's own maxima (dense, and key blocks of 4 over 16 keys) equal the reference
    written as two products, over real queries only: the padding's larger logits are left out."""
    cfg = dataclasses.replace(presets.tiny().model, dtype="float32", attention_block_size=block)
    attn = MLA(cfg, nnx.Rngs(0))
    x, positions, segments = _padded_packed_inputs(cfg)
    _, got = attn(x, positions, segments)
    want = mla_max_logits(attn, x, positions, segments)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _, with_padding = attn(x, positions, jnp.where(segments > 0, segments, 3))
    assert (np.asarray(with_padding) > np.asarray(got) + 1).all()


def _model_cfg(**overrides):
    return small_model_config(num_experts=4, dtype="float32", **overrides)


def _step_without_update(cfg, qk_clip, batch):
    """A train step whose optimizer moves nothing, so all that changes the weights is QK-clip."""
    m = init_model(cfg, seed=5)
    graphdef, params, buffers = split_model(m)
    state = TrainState(jnp.zeros((), jnp.int32), params, buffers, optax.set_to_zero().init(params))
    step = functools.partial(
        train_step,
        graphdef,
        optax.set_to_zero(),
        cfg,
        config_lib.TrainConfig(),
        lambda count: 0.0,
        None,
        qk_clip=qk_clip,
    )
    return m, jax.jit(step)(state, batch)


def _max_logits(graphdef, params, buffers, batch):
    out = nnx.merge(graphdef, params, buffers)(
        batch["tokens"], batch["positions"], batch["segment_ids"]
    )
    return out.attention_max_logits


def test_a_train_step_with_qk_clip_rescales_the_heads_over_the_threshold():
    """A step (its optimizer update zero) rescales the query and key projections of every
    attention (dense and MoE stacks, the MTP depth) by the factors of the maxima of the step's
    own forward, and nothing else; the first layer (whose inputs the clip leaves alone) then has
    each head's largest logit at min(its maximum, the threshold)."""
    cfg = _model_cfg(first_k_dense=1, num_layers=3)
    batch = {k: jnp.asarray(v) for k, v in _packed_batch(np.random.default_rng(3)).items()}
    graphdef, params, buffers = split_model(init_model(cfg, seed=5))
    before = _max_logits(graphdef, params, buffers, batch)
    assert set(before) == {"dense_layers/attn", "moe_layers/attn", "mtp/0/block/attn"}
    every = np.concatenate([np.ravel(v) for v in before.values()])
    threshold = float(np.median(every))
    assert (before["dense_layers/attn"] > threshold).any()
    clip = QKClip(threshold, cfg.qk_nope_head_dim)
    _, (clipped, metrics) = _step_without_update(cfg, clip, batch)
    assert int(metrics["qk_clipped_heads"]) == int((every > threshold).sum()) > 0
    np.testing.assert_allclose(metrics["attention_max_logit"], every.max(), rtol=1e-6)
    _check_clipped(params, clipped.params, before, clip, "q_b_proj")
    first = _max_logits(graphdef, clipped.params, clipped.buffers, batch)["dense_layers/attn"]
    np.testing.assert_allclose(first, np.minimum(before["dense_layers/attn"], threshold), rtol=1e-5)


def _check_clipped(params, clipped, max_logits, clip, q_name):
    """`clipped` is `params` with each attention's query and key projections rescaled by
    `qk_clip` of `max_logits`, and every other weight the same."""
    for path, maxima in max_logits.items():
        attn = attention_params(params, path)
        want = qk_clip(
            attn[q_name][...], attn["kv_b_proj"][...], maxima, clip.threshold, clip.qk_nope_head_dim
        )
        got = attention_params(clipped, path)
        np.testing.assert_allclose(got[q_name][...], want[0], rtol=1e-6)
        np.testing.assert_allclose(got["kv_b_proj"][...], want[1], rtol=1e-6)
    unchanged = dict(jax.tree_util.tree_leaves_with_path(params))
    for path, leaf in jax.tree_util.tree_leaves_with_path(clipped):
        if not any(getattr(k, "key", None) in (q_name, "kv_b_proj") for k in path):
            np.testing.assert_array_equal(leaf, unchanged[path])


def test_qk_clip_of_a_model_without_a_query_latent_scales_its_query_projection():
    """Without q_lora the queries come from `q_proj` [embed, heads, dims]: QK-clip scales it,
    and the first layer's heads (whose inputs the clip leaves alone) then have their largest
    logit at min(their maximum, the threshold)."""
    cfg = _model_cfg(q_lora_rank=None, num_mtp_layers=0, first_k_dense=1, num_layers=2)
    batch = {k: jnp.asarray(v) for k, v in _packed_batch(np.random.default_rng()).items()}
    graphdef, params, buffers = split_model(init_model(cfg, seed=6))
    before = _max_logits(graphdef, params, buffers, batch)
    clip = QKClip(float(np.median(before["dense_layers/attn"])), 8)  # half its heads clipped
    clipped, count = clip(jax.tree.map(jnp.array, params), before)
    assert int(count) > 0 and (before["dense_layers/attn"] > clip.threshold).any()
    _check_clipped(params, clipped, before, clip, "q_proj")
    first = _max_logits(graphdef, clipped, buffers, batch)["dense_layers/attn"]
    np.testing.assert_allclose(
        first, np.minimum(before["dense_layers/attn"], clip.threshold), rtol=1e-5
    )


def test_qk_clip_threshold_zero_is_off_and_a_negative_one_is_refused():
    tiny = presets.tiny()
    assert QKClip.of(tiny.optim, tiny.model) is None
    on = dataclasses.replace(tiny.optim, qk_clip_threshold=50.0)
    assert QKClip.of(on, tiny.model) == QKClip(50.0, tiny.model.qk_nope_head_dim)
    bad = dataclasses.replace(tiny, optim=dataclasses.replace(tiny.optim, qk_clip_threshold=-1.0))
    with pytest.raises(config_lib.ConfigError, match="optim.qk_clip_threshold: must be a finite"):
        config_lib.validate(bad)
