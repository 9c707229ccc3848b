"""MLA against a float64 DeepSeek-V3 reference; RoPE, packing and causality properties."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composer_jax import config, presets
from composer_jax.model import attention, rope
from composer_jax.model.transformer import compute_logits
from tests.model import reference as ref

YARN = config.YarnConfig(
    factor=4.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=0.8,
)

MLA_CFGS = {
    "q_lora": dict(q_lora_rank=32),
    "no_q_lora": dict(q_lora_rank=None),
    "q_lora_yarn": dict(q_lora_rank=32, rope_scaling=YARN),
    # Keys 5 at a time: 12 keys leave a padded last block.
    "q_lora_yarn_blockwise": dict(q_lora_rank=32, rope_scaling=YARN, attention_block_size=5),
    "no_q_lora_blockwise": dict(q_lora_rank=None, attention_block_size=4),
}


def _mla_cfg(**kw):
    return dataclasses.replace(presets.tiny().model, dtype="float32", **kw)


def _mla_params(mla) -> dict:
    names = ["kv_a_proj", "kv_b_proj", "o_proj"]
    names += ["q_proj"] if mla.cfg.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    p = {n: np.asarray(getattr(mla, n)[...]) for n in names}
    p["kv_a_norm"] = np.asarray(mla.kv_a_norm.scale[...])
    if mla.cfg.q_lora_rank is not None:
        p["q_a_norm"] = np.asarray(mla.q_a_norm.scale[...])
    return p


def _randomize_norms(mla, rng):
    """Norm scales start at one; make them random so the reference would notice them missing."""
    norms = [mla.kv_a_norm] + ([mla.q_a_norm] if mla.cfg.q_lora_rank is not None else [])
    for norm in norms:
        norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def _mla_apply(graphdef, state, x, positions, segments):
    return nnx.merge(graphdef, state)(x, positions, segments)[0]


def _packed_row_inputs(T=12, split=5, offset=0):
    positions = np.concatenate([np.arange(split), np.arange(T - split)]) + offset
    segments = np.concatenate([np.ones(split), 2 * np.ones(T - split)])
    return positions.astype(np.int32), segments.astype(np.int32)


@pytest.mark.parametrize("name", sorted(MLA_CFGS))
def test_mla_matches_float64_reference(name):
    cfg = _mla_cfg(**MLA_CFGS[name])
    rng = np.random.default_rng(0)
    mla = attention.MLA(cfg, nnx.Rngs(0))
    _randomize_norms(mla, rng)
    B, T = 2, 12
    x = rng.normal(size=(B, T, cfg.hidden_size)).astype(np.float32)
    # Row 0: one document at large positions (where YaRN's frequency blend matters);
    # row 1: two packed documents with restarting positions.
    pos0, seg0 = np.arange(T, dtype=np.int32) + 1000, np.ones(T, np.int32)
    pos1, seg1 = _packed_row_inputs(T)
    positions, segments = np.stack([pos0, pos1]), np.stack([seg0, seg1])
    graphdef, state = nnx.split(mla)
    got = np.asarray(
        _mla_apply(graphdef, state, jnp.asarray(x), jnp.asarray(positions), jnp.asarray(segments))
    )
    p = _mla_params(mla)
    want = np.stack([ref.mla(x[b], positions[b], segments[b], p, cfg) for b in range(B)])
    assert got.shape == (B, T, cfg.hidden_size)
    # Atol covers float32 RoPE angles at positions ~1000.
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * np.abs(want).max())


def test_yarn_constants_match_reference():
    cfg = _mla_cfg(rope_scaling=YARN)
    got = rope.inverse_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, YARN)
    want = ref.inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, YARN)
    plain = ref.inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta)
    # The ramp is partial for this config: some pairs keep, some interpolate, some blend.
    ratio = want / plain
    assert np.isclose(ratio[0], 1.0) and np.isclose(ratio[-1], 1 / YARN.factor)
    assert ((ratio < 1 - 1e-3) & (ratio > 1 / YARN.factor + 1e-3)).any()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    m = ref.yarn_mscale(YARN.factor, YARN.mscale_all_dim)
    np.testing.assert_allclose(rope.softmax_scale(cfg), cfg.qk_head_dim**-0.5 * m * m, rtol=1e-12)
    np.testing.assert_allclose(
        rope.rope_attention_factor(YARN),
        ref.yarn_mscale(YARN.factor, YARN.mscale)
        / ref.yarn_mscale(YARN.factor, YARN.mscale_all_dim),
        rtol=1e-12,
    )


def test_rope_scores_depend_only_on_relative_position():
    cfg = _mla_cfg()
    mla = attention.MLA(cfg, nnx.Rngs(1))
    rng = np.random.default_rng(1)
    T = 10
    x = jnp.asarray(rng.normal(size=(1, T, cfg.hidden_size)), jnp.float32)
    positions = np.sort(rng.choice(50, size=T, replace=False))[None].astype(np.int32)

    @jax.jit
    def rope_scores(positions):
        cos, sin = rope.rope_tables(positions, cfg)
        _, q_rope = mla.queries(x, cos, sin)
        _, k_rope = mla.latents(x, cos, sin)
        return jnp.einsum("bthk,bsk->bhts", q_rope, k_rope)

    base = np.asarray(rope_scores(jnp.asarray(positions)))
    for shift in (1, 7, 123):
        shifted = np.asarray(rope_scores(jnp.asarray(positions + shift)))
        np.testing.assert_allclose(shifted, base, rtol=1e-4, atol=1e-4 * np.abs(base).max())
    # ...and the positions do matter: a non-uniform change alters the scores.
    stretched = np.asarray(rope_scores(jnp.asarray(positions * 2)))
    assert np.abs(stretched - base).max() > 1e-2 * np.abs(base).max()

    # The whole attention output is shift-invariant too.
    segments = jnp.ones((1, T), jnp.int32)
    graphdef, state = nnx.split(mla)
    out = np.asarray(_mla_apply(graphdef, state, x, jnp.asarray(positions), segments))
    out_shift = np.asarray(_mla_apply(graphdef, state, x, jnp.asarray(positions + 37), segments))
    np.testing.assert_allclose(out_shift, out, rtol=1e-4, atol=1e-4 * np.abs(out).max())


def test_attention_mask_by_segments_and_positions():
    positions, segments = _packed_row_inputs(8, 3)
    got = np.asarray(
        attention.attention_mask(
            jnp.asarray(segments[None]),
            jnp.asarray(positions[None]),
            jnp.asarray(segments[None]),
            jnp.asarray(positions[None]),
        )
    )[0]
    want = np.zeros((8, 8), bool)
    want[:3, :3] = np.tril(np.ones((3, 3), bool))
    want[3:, 3:] = np.tril(np.ones((5, 5), bool))
    np.testing.assert_array_equal(got, want)


def test_packed_documents_match_documents_alone(model_and_cfg):
    m, cfg = model_and_cfg
    rng = np.random.default_rng(2)
    T, split = 12, 5
    tokens = rng.integers(0, cfg.vocab_size, size=(1, T)).astype(np.int32)
    positions, segments = _packed_row_inputs(T, split)
    packed = np.asarray(
        compute_logits(m, tokens, jnp.asarray(positions[None]), jnp.asarray(segments[None]))
    )
    first = np.asarray(compute_logits(m, tokens[:, :split]))
    second = np.asarray(compute_logits(m, tokens[:, split:]))
    np.testing.assert_allclose(packed[:, :split], first, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[:, split:], second, rtol=1e-5, atol=1e-5)
    # Without the segment ids the second document would see the first: outputs differ.
    unpacked = np.asarray(compute_logits(m, tokens))
    assert np.abs(unpacked[:, split:] - second).max() > 1e-3


def test_changing_a_token_never_changes_earlier_logits(model_and_cfg):
    m, cfg = model_and_cfg
    rng = np.random.default_rng(3)
    T = 12
    tokens = rng.integers(0, cfg.vocab_size, size=(1, T)).astype(np.int32)
    rows = [tokens[0]]
    for j in range(T):
        changed = tokens[0].copy()
        changed[j] = (changed[j] + 1 + rng.integers(cfg.vocab_size - 1)) % cfg.vocab_size
        rows.append(changed)
    logits = np.asarray(compute_logits(m, np.stack(rows)))
    base = logits[0]
    for j in range(T):
        got = logits[j + 1]
        np.testing.assert_allclose(got[:j], base[:j], rtol=1e-6, atol=1e-6)
        assert np.abs(got[j] - base[j]).max() > 1e-3


def _dense_attention(q, k, v, visibility, scale):
    """The dense product MLA.attend computes, on expanded queries, keys and values."""
    scores = jnp.einsum("bthk,bshk->bhts", q, k, preferred_element_type=jnp.float32)
    mask = attention.attention_mask(*visibility)
    scores = jnp.where(mask[:, None], scores * scale, attention._MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bhts,bshv->bthv", probs, v)


def _attention_inputs(rng, dtype, B=2, T=9, S=23, H=3, K=6, V=5):
    """Random queries over keys as context parallelism sees them: T queries from the middle of
    S keys in a shuffled order, row 0 two packed documents, row 1 one."""
    key_positions = np.stack([np.concatenate([np.arange(11), np.arange(12)]), np.arange(S)])
    key_segments = np.stack([np.repeat([1, 2], [11, 12]), np.ones(S, int)])
    order = rng.permutation(S)
    key_positions, key_segments = key_positions[:, order], key_segments[:, order]
    queries = order[7 : 7 + T]
    visibility = tuple(
        jnp.asarray(a, jnp.int32)
        for a in (key_segments[:, queries], key_positions[:, queries], key_segments, key_positions)
    )
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), dtype)
        for shape in ((B, T, H, K), (B, S, H, K), (B, S, H, V))
    )
    return q, k, v, visibility


@pytest.mark.parametrize("block", [1, 4, 23, 64])
def test_blockwise_attention_and_its_gradients_equal_the_dense_product(block):
    """Online softmax over key blocks (padded where the block does not divide the keys) equals
    the dense product, and its hand-written backward equals autodiff of the dense product."""
    rng = np.random.default_rng(block)
    q, k, v, visibility = _attention_inputs(rng, jnp.float32)
    scale = 0.37
    got = attention.blockwise_attention(q, k, v, visibility, scale, block)
    want = _dense_attention(q, k, v, visibility, scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    cotangent = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)

    def grads(fn):
        loss = lambda q, k, v: (fn(q, k, v, visibility, scale) * cotangent).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    blockwise = functools.partial(attention.blockwise_attention, block=block)
    for name, g, w in zip("qkv", grads(blockwise), grads(_dense_attention)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)


def test_key_block_masks_are_not_hoisted_out_of_a_layer_scan():
    """Under a scanned stack of layers the visibility is the same in every layer; the gradient's
    program must still build each block's mask inside the block loop, never every block's
    [blocks, B, H, T, block] mask at once (which scan's partial evaluation used to hoist)."""
    rng = np.random.default_rng(0)
    q, k, v, visibility = _attention_inputs(rng, jnp.float32)
    block = 4
    blocks = -(-k.shape[1] // block)

    def layers(q):
        def layer(carry, _):
            out = attention.blockwise_attention(q + carry, k, v, visibility, 0.37, block)
            return carry + out.mean(), None

        return jax.lax.scan(layer, 0.0, None, length=3)[0]

    program = str(jax.make_jaxpr(jax.grad(layers))(q))
    B, T, H = q.shape[:3]
    for stacked in (f"bool[{blocks},{B},{H},{T},{block}]", f"bool[{blocks},{B},1,{T},{block}]"):
        assert stacked not in program
    assert f"bool[{B},{H},{T},{block}]" in program  # one tile's mask, inside the loop


def test_blockwise_attention_in_bfloat16_stays_close_to_float32():
    rng = np.random.default_rng(7)
    q, k, v, visibility = _attention_inputs(rng, jnp.float32)
    want = _dense_attention(q, k, v, visibility, 0.37)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = attention.blockwise_attention(*low, visibility, 0.37, 8)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2)
