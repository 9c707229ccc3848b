"""Independent float64 numpy references for the model tests (written from the DeepSeek-V3 papers and
the Hugging Face DeepSeek-V3 modelling code, not from composer_jax)."""

from __future__ import annotations

import math

import numpy as np


def f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def rms_norm(x, scale, eps):
    x = f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * f64(scale)


def swiglu(x, gate, up, down):
    return (silu(x @ f64(gate)) * (x @ f64(up))) @ f64(down)


# ----------------------------------------------------------------------------- routing


# Value given to experts of dropped groups before the final top-k. DeepSeek-V3's own inference code
# (and transformers 5.x) use -inf, so dropped groups are never chosen; transformers 4.x used 0.0,
# which lets a dropped expert beat kept experts whose biased score is negative.
GROUP_MASK_VALUE = -np.inf

# DeepSeek-V3 builds the q and kv latent RMSNorms with the default eps (1e-6), not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def route_token(
    scores, bias, *, k, n_group, topk_group, scaling, normalize=True, mask_value=GROUP_MASK_VALUE
):
    """DeepSeek-V3 routing for one token: returns (indices [k], weights [k])."""
    scores = f64(scores)
    choice = scores + f64(bias)
    num_experts = choice.shape[0]
    if n_group > 1:
        per_group = num_experts // n_group
        grouped = choice.reshape(n_group, per_group)
        group_score = np.sort(grouped, axis=-1)[:, ::-1][:, :2].sum(-1)
        kept = np.argsort(-group_score, kind="stable")[:topk_group]
        keep = np.zeros(n_group, bool)
        keep[kept] = True
        choice = np.where(np.repeat(keep, per_group), choice, mask_value)
    indices = np.argsort(-choice, kind="stable")[:k]
    weights = scores[indices]
    if normalize:
        weights = weights / (weights.sum() + 1e-20)
    return indices, weights * scaling


def route(scores_NE, bias_E, **kw):
    out = [route_token(s, bias_E, **kw) for s in f64(scores_NE)]
    return np.stack([o[0] for o in out]), np.stack([o[1] for o in out])


def route_kwargs(cfg) -> dict:
    return dict(
        k=cfg.num_experts_per_tok,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        scaling=cfg.routed_scaling_factor,
        normalize=cfg.norm_topk_prob,
    )


def moe(x_ND, p, cfg, forced_NK=None):
    """Dense loop over tokens and their experts, float64.

    `p` holds numpy arrays: router, bias, gate, up, down and optionally shared_gate, shared_up,
    shared_down. Returns (out [N, D], indices [N, k]).
    """
    x_ND = f64(x_ND)
    scores = sigmoid(x_ND @ f64(p["router"]))
    if forced_NK is None:
        indices, weights = route(scores, p["bias"], **route_kwargs(cfg))
    else:
        indices = np.asarray(forced_NK)
        weights = np.take_along_axis(scores, indices, axis=-1)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        weights = weights * cfg.routed_scaling_factor
    out = np.zeros_like(x_ND)
    for n in range(x_ND.shape[0]):
        for e, w in zip(indices[n], weights[n]):
            out[n] += w * swiglu(x_ND[n], p["gate"][e], p["up"][e], p["down"][e])
    if "shared_gate" in p:
        out += swiglu(x_ND, p["shared_gate"], p["shared_up"], p["shared_down"])
    return out, indices


# ----------------------------------------------------------------------------- rope / attention


def yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(dim, base, yarn=None):
    """HF DeepseekV3YarnRotaryEmbedding inv_freq (float64)."""
    extra = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if yarn is None:
        return extra

    def correction_dim(rotations):
        return (
            dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
        ) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    mask = 1.0 - ramp
    inter = extra / yarn.factor
    return inter * (1.0 - mask) + extra * mask


def rope_hf(x, positions, dim, base, yarn=None):
    """HF DeepSeek-V3 apply_rotary_pos_emb: de-interleave, then rotate-half. x [T, ..., dim]."""
    x = f64(x)
    freqs = f64(positions)[:, None] * inv_freq(dim, base, yarn)[None]
    emb = np.concatenate([freqs, freqs], axis=-1)
    factor = (
        1.0
        if yarn is None
        else (yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim))
    )
    cos, sin = np.cos(emb) * factor, np.sin(emb) * factor
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (dim,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    x = np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    half = dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def mla(x_TD, positions_T, segments_T, p, cfg):
    """Multi-head latent attention for one sequence, float64. `p` holds numpy parameter arrays."""
    x = f64(x_TD)
    H, nope, rope_dim, vdim = (
        cfg.num_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    )
    R = cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        q = np.einsum("td,dhk->thk", x, f64(p["q_proj"]))
    else:
        cq = rms_norm(x @ f64(p["q_a_proj"]), p["q_a_norm"], LATENT_NORM_EPS)
        q = np.einsum("tr,rhk->thk", cq, f64(p["q_b_proj"]))
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    kv = x @ f64(p["kv_a_proj"])
    c_kv = rms_norm(kv[:, :R], p["kv_a_norm"], LATENT_NORM_EPS)
    k_pe = kv[:, R:]
    kvb = np.einsum("tr,rhk->thk", c_kv, f64(p["kv_b_proj"]))
    k_nope, v = kvb[..., :nope], kvb[..., nope:]
    q_pe = rope_hf(q_pe, positions_T, rope_dim, cfg.rope_theta, cfg.rope_scaling)
    k_pe = rope_hf(k_pe, positions_T, rope_dim, cfg.rope_theta, cfg.rope_scaling)
    T = x.shape[0]
    q_full = np.concatenate([q_nope, q_pe], axis=-1)
    k_full = np.concatenate([k_nope, np.broadcast_to(k_pe[:, None], (T, H, rope_dim))], axis=-1)
    scale = (nope + rope_dim) ** -0.5
    if cfg.rope_scaling is not None and cfg.rope_scaling.mscale_all_dim:
        m = yarn_mscale(cfg.rope_scaling.factor, cfg.rope_scaling.mscale_all_dim)
        scale *= m * m
    scores = np.einsum("thk,shk->hts", q_full, k_full) * scale
    pos, seg = np.asarray(positions_T), np.asarray(segments_T)
    visible = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    scores = np.where(visible[None], scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("hts,shk->thk", probs, v)
    assert out.shape[-1] == vdim
    return np.einsum("thk,hkd->td", out, f64(p["o_proj"]))


# ----------------------------------------------------------------------------- parameter counts


def param_counts(cfg) -> dict:
    """Parameter counts of the DeepSeek-V3 architecture from the config alone."""
    D, H, V = cfg.hidden_size, cfg.num_heads, cfg.vocab_size
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank is None:
        attn = D * H * qk
    else:
        attn = D * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * H * qk
    attn += (
        D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        + cfg.kv_lora_rank
        + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        + H * cfg.v_head_dim * D
    )
    dense_block = attn + 2 * D + 3 * D * cfg.intermediate_size
    E, F = cfg.num_experts, cfg.moe_intermediate_size
    routed_per_layer = 3 * E * D * F
    moe_block = attn + 2 * D + D * E + routed_per_layer + 3 * D * F * cfg.num_shared_experts
    mtp_layer = 2 * D + 2 * D * D + dense_block + D
    n_moe = cfg.num_layers - cfg.first_k_dense
    mtp = cfg.num_mtp_layers * mtp_layer
    total = V * D + cfg.first_k_dense * dense_block + n_moe * moe_block + D + D * V + mtp
    routed = n_moe * routed_per_layer
    return dict(
        total=total,
        routed=routed,
        mtp=mtp,
        embedding=V * D,
        output_head=D * V,
        active=total - mtp - routed + routed * cfg.num_experts_per_tok // E,
    )
