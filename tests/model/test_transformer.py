"""Scanned stacks vs an unrolled loop, MTP dependence structure, logits, bf16 and accounting."""

from __future__ import annotations

import dataclasses
import functools
import time
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import presets
from composer_jax.interop.hf import config_from_hf
from composer_jax.model import accounting, rope
from composer_jax.model.transformer import MTPLayer, Transformer, compute_logits
from tests.model import reference as ref


@functools.partial(jax.jit, static_argnums=(0, 5))
def _forward(graphdef, state, tokens, positions=None, segments=None, with_mtp=True):
    return nnx.merge(graphdef, state)(tokens, positions, segments, with_mtp=with_mtp)


def _run(m, tokens, segments=None, with_mtp=False):
    """Jitted forward with explicit positions and segment ids (one compilation per shape)."""
    B, T = tokens.shape
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    if segments is None:
        segments = np.ones((B, T), np.int32)
    graphdef, state = nnx.split(m)
    return _forward(
        graphdef,
        state,
        jnp.asarray(tokens),
        jnp.asarray(positions),
        jnp.asarray(segments),
        with_mtp,
    )


def _tokens(cfg, shape, seed):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=shape).astype(np.int32)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _unrolled(dense_gd, moe_gd, embed_table, dense_state, moe_state, tokens, positions, segments):
    """The main stack as a python loop: merge one layer at a time from the stacked state."""
    x = jnp.take(embed_table, tokens, axis=0)
    indices, loads = [], []
    for graphdef, state in ((dense_gd, dense_state), (moe_gd, moe_state)):
        num = jax.tree.leaves(state)[0].shape[0]
        for i in range(num):
            layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
            x, idx, stats, _ = layer(x, positions, segments)
            if idx is not None:
                indices.append(idx)
                loads.append(stats.load_E)
    return x, jnp.stack(indices), jnp.stack(loads)


def test_scan_equals_unrolled_layers(model_and_cfg):
    m, cfg = model_and_cfg
    B, T = 2, 10
    tokens = _tokens(cfg, (B, T), 0)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()
    segments = np.ones((B, T), np.int32)
    segments[1, 6:] = 0  # padding, excluded from the load
    out = _run(m, tokens, segments)

    dense_gd, dense_state = nnx.split(m.dense_layers)
    moe_gd, moe_state = nnx.split(m.moe_layers)
    assert jax.tree.leaves(dense_state)[0].shape[0] == cfg.first_k_dense
    assert jax.tree.leaves(moe_state)[0].shape[0] == cfg.num_moe_layers
    # Stacked copies are independently initialised.
    w = np.asarray(m.moe_layers.attn.o_proj[...])
    assert np.abs(w[0] - w[1]).max() > 1e-3
    x, indices, loads = _unrolled(
        dense_gd,
        moe_gd,
        m.embed[...],
        dense_state,
        moe_state,
        jnp.asarray(tokens),
        jnp.asarray(positions),
        jnp.asarray(segments),
    )
    np.testing.assert_allclose(np.asarray(out.hidden_BTD), np.asarray(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.router_indices_LBTK), np.asarray(indices))
    np.testing.assert_array_equal(np.asarray(out.expert_load_LE), np.asarray(loads))
    # The library's own unrolled mode (cfg.scan_layers=False) agrees as well.
    if "scan_layers" in {f.name for f in dataclasses.fields(cfg)}:
        unrolled_cfg = dataclasses.replace(cfg, scan_layers=not cfg.scan_layers)
        m_unrolled = nnx.merge(
            nnx.graphdef(nnx.eval_shape(lambda: Transformer(unrolled_cfg, nnx.Rngs(0)))),
            nnx.state(m),
        )
        other = _run(m_unrolled, tokens, segments)
        np.testing.assert_allclose(
            np.asarray(other.hidden_BTD), np.asarray(out.hidden_BTD), rtol=1e-5, atol=1e-5
        )
        np.testing.assert_array_equal(
            np.asarray(other.router_indices_LBTK), np.asarray(out.router_indices_LBTK)
        )
    # Loads are bincounts of the used experts over non-padding tokens, per MoE layer.
    idx = np.asarray(out.router_indices_LBTK)
    assert idx.shape == (cfg.num_moe_layers, B, T, cfg.num_experts_per_tok)
    for layer in range(cfg.num_moe_layers):
        want = np.bincount(idx[layer][segments > 0].reshape(-1), minlength=cfg.num_experts)
        np.testing.assert_array_equal(np.asarray(out.expert_load_LE)[layer], want)


def test_forced_router_indices_through_transformer(model_and_cfg):
    m, cfg = model_and_cfg
    B, T = 2, 10
    tokens = _tokens(cfg, (B, T), 1)
    graphdef, state = nnx.split(m)

    @jax.jit
    def fwd(state, forced):
        return nnx.merge(graphdef, state)(
            jnp.asarray(tokens), forced_indices_LBTK=forced, with_mtp=False
        )

    free = _run(m, tokens)
    own = fwd(state, free.router_indices_LBTK)
    # A different XLA program (no top-k), so equal up to float32 rounding.
    np.testing.assert_allclose(
        np.asarray(own.hidden_BTD), np.asarray(free.hidden_BTD), rtol=1e-6, atol=1e-6
    )
    rng = np.random.default_rng(2)
    forced = np.stack(
        [
            rng.permutation(cfg.num_experts)[: cfg.num_experts_per_tok]
            for _ in range(cfg.num_moe_layers * B * T)
        ]
    )
    forced = forced.reshape(cfg.num_moe_layers, B, T, -1).astype(np.int32)
    other = fwd(state, jnp.asarray(forced))
    np.testing.assert_array_equal(np.asarray(other.router_indices_LBTK), forced)
    assert np.abs(np.asarray(other.hidden_BTD) - np.asarray(free.hidden_BTD)).max() > 1e-3


def test_mtp_depth_sees_exactly_d_tokens_ahead(model_and_cfg):
    m, cfg = model_and_cfg
    assert cfg.num_mtp_layers == 2
    T = 10
    rng = np.random.default_rng(3)
    base = _tokens(cfg, (T,), 4)
    rows = [base]
    for j in range(T):
        row = base.copy()
        row[j] = (row[j] + 1 + rng.integers(cfg.vocab_size - 1)) % cfg.vocab_size
        rows.append(row)
    out = _run(m, np.stack(rows), with_mtp=True)
    mtp = np.asarray(out.mtp_hidden_DBTD)
    assert mtp.shape == (cfg.num_mtp_layers, T + 1, T, cfg.hidden_size)
    hidden = np.asarray(out.hidden_BTD)
    for j in range(T):
        # Main path: causal.
        np.testing.assert_allclose(hidden[j + 1, :j], hidden[0, :j], rtol=1e-6, atol=1e-6)
        for index in range(cfg.num_mtp_layers):
            d = index + 1  # depth d mixes in the token d steps ahead
            first_affected = j - d
            if first_affected < 0:
                continue
            np.testing.assert_allclose(
                mtp[index, j + 1, :first_affected],
                mtp[index, 0, :first_affected],
                rtol=1e-6,
                atol=1e-6,
                err_msg=f"depth {d}: token {j} leaked to earlier positions",
            )
            assert (
                np.abs(mtp[index, j + 1, first_affected] - mtp[index, 0, first_affected]).max()
                > 1e-4
            ), f"depth {d}, position {first_affected} does not see token {j}"
    # The MTP states are returned output-normed (ready for the shared head).
    for index, layer in enumerate(m.mtp):
        scale = np.asarray(layer.out_norm.scale[...], np.float64)
        rms = np.sqrt(np.mean((mtp[index] / scale) ** 2, -1))
        np.testing.assert_allclose(rms, 1.0, rtol=1e-3)


def test_mtp_mix_is_both_norms_concatenated_and_projected():
    """DeepSeek-V3's MTP input M [RMSNorm(h); RMSNorm(Emb(t + d))] against float64 numpy, each
    norm with its own random scale and the two inputs of different magnitudes, so swapped norms
    or a swapped concatenation show."""
    cfg = dataclasses.replace(presets.tiny().model, dtype="float32", param_dtype="float32")
    layer = MTPLayer(cfg, nnx.Rngs(int(np.random.default_rng().integers(1 << 31))))
    rng = np.random.default_rng()
    d = cfg.hidden_size
    scales = rng.uniform(0.5, 2.0, (2, d))
    layer.hidden_norm.scale[...] = jnp.asarray(scales[0], jnp.float32)
    layer.embed_norm.scale[...] = jnp.asarray(scales[1], jnp.float32)
    h = rng.standard_normal((2, 5, d)) * 3.0
    e = rng.standard_normal((2, 5, d)) * 0.1 + 0.05
    got = np.asarray(layer.mix(jnp.asarray(h, jnp.float32), jnp.asarray(e, jnp.float32)))

    def rms_norm(x, scale):
        return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + cfg.rms_norm_eps) * scale

    mixed = np.concatenate([rms_norm(h, scales[0]), rms_norm(e, scales[1])], -1)
    want = mixed @ np.asarray(layer.proj[...], np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_compute_logits_float32_and_matches_head(model_and_cfg):
    m, cfg = model_and_cfg
    B, T = 2, 10
    tokens = _tokens(cfg, (B, T), 6)
    logits = compute_logits(m, tokens)
    assert logits.dtype == jnp.float32
    assert logits.shape == (B, T, cfg.vocab_size)
    hidden = np.asarray(_run(m, tokens).hidden_BTD)
    want = ref.rms_norm(hidden, np.asarray(m.final_norm.scale[...]), cfg.rms_norm_eps) @ ref.f64(
        m.lm_head[...]
    )
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4, atol=1e-4)


def test_bfloat16_compute_close_to_float32(model_and_cfg):
    m32, cfg32 = model_and_cfg
    cfg16 = dataclasses.replace(cfg32, dtype="bfloat16")
    # Same float32 parameters; only the compute dtype (held in the graph's config) differs.
    graphdef16 = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg16, nnx.Rngs(0))))
    m16 = nnx.merge(graphdef16, nnx.state(m32))
    assert m16.cfg.dtype == "bfloat16" and m16.moe_layers.mlp.cfg.dtype == "bfloat16"
    tokens = _tokens(cfg32, (2, 10), 7)

    @functools.partial(jax.jit, static_argnums=0)
    def logits_and_routes(graphdef, state, tokens, forced):
        m = nnx.merge(graphdef, state)
        out = m(tokens, forced_indices_LBTK=forced, with_mtp=False)
        return (
            m.logits(out.hidden_BTD),
            out.router_indices_LBTK,
            out.hidden_BTD.dtype == jnp.bfloat16,
        )

    graphdef32, state = nnx.split(m32)
    l32, routes32, _ = logits_and_routes(graphdef32, state, jnp.asarray(tokens), None)
    # Free routing: bf16 may flip a near-tie expert choice for a few tokens, which moves those
    # tokens' outputs a lot; most tokens stay close.
    l16 = np.asarray(compute_logits(m16, tokens))
    assert l16.dtype == np.float32
    per_token = np.linalg.norm(l16 - l32, axis=-1) / np.linalg.norm(l32, axis=-1)
    assert (per_token < 0.05).mean() >= 0.75, per_token
    # With the float32 run's expert choices replayed, every token stays close.
    l16, routes16, is_bf16 = logits_and_routes(graphdef16, state, jnp.asarray(tokens), routes32)
    assert bool(is_bf16)
    np.testing.assert_array_equal(np.asarray(routes16), np.asarray(routes32))
    l16, l32 = np.asarray(l16), np.asarray(l32)
    rel = np.linalg.norm(l16 - l32) / np.linalg.norm(l32)
    assert 1e-4 < rel < 0.03, rel  # really computed in bf16, and still close
    per_token = np.linalg.norm(l16 - l32, axis=-1) / np.linalg.norm(l32, axis=-1)
    assert per_token.max() < 0.05, per_token
    assert (l16.argmax(-1) == l32.argmax(-1)).mean() > 0.9


def _check_counts(counts, cfg):
    want = ref.param_counts(cfg)
    assert counts.total == want["total"]
    assert counts.routed_experts == want["routed"]
    assert counts.mtp == want["mtp"]
    assert counts.embedding == want["embedding"]
    assert counts.output_head == want["output_head"]
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    active = counts.total - counts.mtp - Fraction(counts.routed_experts) * (1 - Fraction(k, E))
    assert counts.active == active == want["active"]


def test_param_counts_match_instantiated_model(model_and_cfg):
    m, cfg = model_and_cfg
    counts = accounting.count_params(cfg)
    real = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert counts.total == real
    assert (
        counts.mtp
        == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(m.mtp, nnx.Param)))
        > 0
    )
    _check_counts(counts, cfg)
    # The expert bias is a buffer, not a parameter.
    assert not any(
        x.shape == (cfg.num_moe_layers, cfg.num_experts)
        for x in jax.tree.leaves(nnx.state(m, nnx.Param))
    )


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_param_counts_of_presets(preset):
    cfg = presets.PRESETS[preset]().model
    _check_counts(accounting.count_params(cfg), cfg)


def test_kimi_k2_counts_without_allocating():
    cfg = presets.kimi_k2_model()
    start = time.perf_counter()
    counts = accounting.count_params(cfg)
    elapsed = time.perf_counter() - start
    assert elapsed < 20.0, elapsed
    assert counts.total == pytest.approx(1.026e12, rel=1e-3)
    assert counts.active == pytest.approx(32.86e9, rel=1e-3)
    want = ref.param_counts(cfg)
    assert counts.total == want["total"]
    assert counts.active == want["active"]
    assert counts.routed_experts == want["routed"]
    assert counts.mtp == 0
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    assert counts.active == counts.total - counts.routed_experts + counts.routed_experts * k // E


# The released DeepSeek-V3 config.json (deepseek-ai/DeepSeek-V3 on the Hugging Face hub).
DEEPSEEK_V3_CONFIG_JSON = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}


def test_deepseek_v3_preset_is_the_released_shape_and_counts_671b():
    """The preset is what loading the released config.json gives (but the MTP head, trained
    from scratch here, and its attention in key blocks), and it counts what DeepSeek reports: 671B in the main model, 36.6B
    activated per token (the embedding lookup not counted)."""
    cfg = presets.deepseek_v3_model()
    released = config_from_hf(DEEPSEEK_V3_CONFIG_JSON)
    assert dataclasses.replace(cfg, num_mtp_layers=0, attention_block_size=None) == released
    counts = accounting.count_params(cfg)
    assert counts.total - counts.mtp == pytest.approx(671.0e9, rel=1e-3)
    assert counts.active - counts.embedding == pytest.approx(36.6e9, rel=2e-3)
    want = ref.param_counts(cfg)
    assert (counts.total, counts.active, counts.routed_experts) == (
        want["total"],
        want["active"],
        want["routed"],
    )


# The released Kimi-K2 config.json's architecture fields (moonshotai/Kimi-K2-Instruct).
KIMI_K2_CONFIG_JSON = {
    **{k: v for k, v in DEEPSEEK_V3_CONFIG_JSON.items() if k != "quantization_config"},
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 0,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "routed_scaling_factor": 2.827,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 131072,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
}


def test_kimi_k2_preset_is_the_released_config_and_its_yarn_the_reference():
    """Loading K2's config.json gives the preset, equal betas (one ramp edge) included, and
    its RoPE frequencies are the float64 reference's."""
    cfg = presets.kimi_k2_model()
    released = config_from_hf(KIMI_K2_CONFIG_JSON)
    assert dataclasses.replace(cfg, attention_block_size=None) == released
    got = rope.inverse_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    want = ref.inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    plain = ref.inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta)
    assert np.isclose(want[0], plain[0]) and np.isclose(want[-1], plain[-1] / 32.0)
