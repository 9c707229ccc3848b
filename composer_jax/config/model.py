"""The model and its mesh: shapes, numerics, parallel layout, and their checks."""

from __future__ import annotations

import dataclasses
import math

from composer_jax.config.base import check as _check

EXPERT_PRECISIONS = ("bf16", "mxfp8", "nvfp4_fwd_mxfp8_bwd")
EXPERT_BACKENDS = ("reference", "pallas_hopper", "pallas_blackwell")
EXPERT_GEMM_IMPLS = ("auto", "ragged_dot", "tiled")


@dataclasses.dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE extension (DeepSeek-V3 flavour, including the softmax-scale mscale adjustment)."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


# Keys per block for long contexts (the 1T presets, launch.plan's layout change): a [T, 1024]
# score tile per head instead of a dense [T, S] product.
LONG_CONTEXT_ATTENTION_BLOCK = 1024
# The expert capacity a plan tries when a dropless exchange does not fit (`mesh.ep_capacity`):
# Switch Transformer's training factor; the drop rate it costs is measured per run.
PLANNED_EXPERT_CAPACITY = 1.25


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V3 / Kimi-K2 shaped MoE transformer with MLA attention and MTP heads."""

    vocab_size: int = 259
    hidden_size: int = 64
    num_layers: int = 2
    first_k_dense: int = 1
    # Multi-head latent attention.
    num_heads: int = 4
    q_lora_rank: int | None = 32  # None: a single full-rank query projection.
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rope_theta: float = 10000.0
    rope_scaling: YarnConfig | None = None
    max_position_embeddings: int = 4096
    # Feed-forward: dense layers and routed experts plus shared expert(s).
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    num_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    router_bias_update_rate: float = 1e-3  # aux-loss-free balancing step (gamma in DeepSeek-V3).
    # DeepSeek-V3's complementary sequence-wise balance loss: pretraining adds alpha x the mean
    # over rows of sum_i f_i P_i per MoE layer (the paper's alpha is 1e-4); 0 leaves it out.
    balance_loss_alpha: float = 0.0
    # Router replay: a replayed expert is kept only if the trainer's score for it is at least this
    # times the trainer's k-th best score, else the trainer's own next choice replaces it (the
    # rate is logged as router_replace_rate); 0 keeps every replayed expert.
    replay_min_ratio: float = 0.5
    # Expert grouped GEMM: "bf16" (compute dtype), "mxfp8", or "nvfp4_fwd_mxfp8_bwd"; and the
    # backend that runs the low-precision recipes.
    expert_precision: str = "bf16"
    expert_backend: str = "reference"
    # The bf16 grouped GEMM: "ragged_dot", "tiled" (fast on CPU), or "auto" (chosen by platform).
    expert_gemm_impl: str = "auto"
    rms_norm_eps: float = 1e-6
    # Multi-token prediction: number of extra sequential depths (0 disables MTP).
    num_mtp_layers: int = 1
    # Numerics: parameters are kept in param_dtype, the forward pass computes in dtype.
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    # Execution (no effect on parameters): scan stacked layers (compile time flat in depth) and
    # rematerialise each layer's activations in the backward pass (memory for compute).
    scan_layers: bool = True
    remat: bool = False
    # Attention over keys `attention_block_size` at a time with an online softmax: no [T, S]
    # scores or mask are held (RESULTS: 11x fewer temporaries at 4096 tokens); None: one dense
    # [T, S] product per head.
    attention_block_size: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Physical mesh axis sizes; -1 on one axis means 'all remaining devices'.

    `ep` names the axes whose devices form one expert-parallel group (experts are split over
    them; the other axes shard each expert's matrices). `ep_quantize` is the precision of tokens
    on their way to the experts: "mxfp8" (DeepSeek-V3 style; results come back in the compute
    dtype), "none", or "auto" (mxfp8 on GPU, none elsewhere). `ep_dispatch` is the exchange:
    "ragged" (ragged all-to-all: only real rows travel; GPU), "padded" (all-to-all of worst-case
    buffers; any backend), "ragged_emulated" (ragged bookkeeping over all-gathers, for CPU tests),
    or "auto" (ragged on GPU, padded elsewhere). `ep_capacity` bounds the rows each device sends
    each member of its group to ceil(ep_capacity x its token slots / group size): buffers and
    wire bytes shrink by group / ep_capacity, rows past the bound are dropped (counted as
    `expert_drop_rate`); None keeps the exchange dropless with worst-case buffers.
    """

    replica: int = 1
    fsdp: int = -1
    cp: int = 1
    ep: tuple[str, ...] = ("fsdp", "cp")
    ep_quantize: str = "auto"
    ep_dispatch: str = "auto"
    ep_capacity: float | None = None


def validate_model(m: ModelConfig, where: str = "model") -> None:
    """Rejects shapes the model cannot build, naming the field at fault."""
    _check_shapes(m, where)
    _check_routing(m, where)
    _check_numerics(m, where)


def _check_shapes(m: ModelConfig, where: str) -> None:
    for name in (
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_heads",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "v_head_dim",
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
    ):
        _check(getattr(m, name) > 0, f"{where}.{name}", f"must be positive, got {getattr(m, name)}")
    _check(
        m.qk_rope_head_dim > 0 and m.qk_rope_head_dim % 2 == 0,
        f"{where}.qk_rope_head_dim",
        f"must be a positive even number (RoPE rotates pairs), got {m.qk_rope_head_dim}",
    )
    _check(
        m.q_lora_rank is None or m.q_lora_rank > 0,
        f"{where}.q_lora_rank",
        f"must be positive or None, got {m.q_lora_rank}",
    )
    _check(
        0 <= m.first_k_dense <= m.num_layers,
        f"{where}.first_k_dense",
        f"must lie in [0, num_layers={m.num_layers}], got {m.first_k_dense}",
    )
    _check(m.num_shared_experts >= 0, f"{where}.num_shared_experts", "must be >= 0")
    _check(m.num_mtp_layers >= 0, f"{where}.num_mtp_layers", "must be >= 0")
    _check(
        m.attention_block_size is None or m.attention_block_size > 0,
        f"{where}.attention_block_size",
        f"must be positive or None, got {m.attention_block_size}",
    )


def _check_routing(m: ModelConfig, where: str) -> None:
    """Expert groups and top-k: every token must be able to reach its k experts."""
    _check(
        m.num_experts % m.n_group == 0,
        f"{where}.n_group",
        f"must divide num_experts={m.num_experts}, got {m.n_group}",
    )
    _check(
        m.topk_group <= m.n_group,
        f"{where}.topk_group",
        f"must be <= n_group={m.n_group}, got {m.topk_group}",
    )
    _check(
        m.num_experts_per_tok <= m.num_experts,
        f"{where}.num_experts_per_tok",
        f"top-k={m.num_experts_per_tok} exceeds num_experts={m.num_experts}",
    )
    reachable = m.topk_group * (m.num_experts // m.n_group)
    _check(
        m.num_experts_per_tok <= reachable,
        f"{where}.num_experts_per_tok",
        f"top-k={m.num_experts_per_tok} exceeds the {reachable} experts in topk_group="
        f"{m.topk_group} groups",
    )
    _check(0 <= m.replay_min_ratio <= 1, f"{where}.replay_min_ratio", "must lie in [0, 1]")
    _check(
        0 <= m.balance_loss_alpha < float("inf"),
        f"{where}.balance_loss_alpha",
        f"must be a finite weight >= 0 (0 leaves the balance loss out), got {m.balance_loss_alpha}",
    )


def _check_numerics(m: ModelConfig, where: str) -> None:
    """Dtypes, the expert GEMM's precision, backend and implementation, RoPE scaling."""
    for name in ("dtype", "param_dtype"):
        _check(
            getattr(m, name) in ("float32", "bfloat16", "float16"),
            f"{where}.{name}",
            f"must be float32, bfloat16 or float16, got {getattr(m, name)!r}",
        )
    _check(
        m.expert_precision in EXPERT_PRECISIONS,
        f"{where}.expert_precision",
        f"must be one of {EXPERT_PRECISIONS}, got {m.expert_precision!r}",
    )
    _check(
        m.expert_backend in EXPERT_BACKENDS,
        f"{where}.expert_backend",
        f"must be one of {EXPERT_BACKENDS}, got {m.expert_backend!r}",
    )
    _check(
        m.expert_gemm_impl in EXPERT_GEMM_IMPLS,
        f"{where}.expert_gemm_impl",
        f"must be one of {EXPERT_GEMM_IMPLS}, got {m.expert_gemm_impl!r}",
    )
    _check(
        m.expert_gemm_impl == "auto" or m.expert_precision == "bf16",
        f"{where}.expert_gemm_impl",
        f"{m.expert_gemm_impl!r} applies to expert_precision='bf16' only (the low-precision "
        f"recipes pick their kernels with expert_backend), got {m.expert_precision!r}",
    )
    if m.rope_scaling is not None:
        _check(m.rope_scaling.factor >= 1.0, f"{where}.rope_scaling.factor", "must be >= 1")
        _check(  # equal betas are valid: Kimi-K2 ships beta_fast = beta_slow = 1
            m.rope_scaling.beta_fast >= m.rope_scaling.beta_slow,
            f"{where}.rope_scaling.beta_fast",
            "must be at least beta_slow",
        )


def ep_group_size(mesh: MeshConfig, num_devices: int) -> int:
    """Devices in one expert-parallel group: the product of the `ep` axes' resolved sizes."""
    shape = mesh_shape(mesh, num_devices)
    return math.prod(shape[axis] for axis in mesh.ep)


def mesh_shape(mesh: MeshConfig, num_devices: int) -> dict[str, int]:
    """Resolves the single -1 axis so that the product equals `num_devices`."""
    sizes = {"replica": mesh.replica, "fsdp": mesh.fsdp, "cp": mesh.cp}
    free = [k for k, v in sizes.items() if v == -1]
    _check(len(free) <= 1, f"mesh.{free[-1] if free else ''}", "at most one axis may be -1")
    for k, v in sizes.items():
        _check(v == -1 or v > 0, f"mesh.{k}", f"must be positive or -1, got {v}")
    fixed = 1
    for v in sizes.values():
        fixed *= v if v != -1 else 1
    if free:
        _check(
            num_devices % fixed == 0,
            f"mesh.{free[0]}",
            f"{num_devices} devices are not divisible by the other axes' product {fixed}",
        )
        sizes[free[0]] = num_devices // fixed
    _check(
        sizes["replica"] * sizes["fsdp"] * sizes["cp"] == num_devices,
        "mesh",
        f"axes {sizes} do not multiply to the {num_devices} available devices",
    )
    return sizes
