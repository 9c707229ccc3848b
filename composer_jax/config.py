"""Typed experiment configuration: frozen dataclasses are the source of truth.

`launch/` turns these into `ml_collections.ConfigDict`s so every field can be overridden from the
command line (`--config.model.num_layers=4`), then rebuilds the dataclasses with `from_dict`, which
rejects unknown fields and wrong types, and `validate`, which rejects contradictory values. Both name
the offending field and run before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

EXPERT_PRECISIONS = ("bf16", "mxfp8", "nvfp4_fwd_mxfp8_bwd")
EXPERT_BACKENDS = ("reference", "xla", "pallas_hopper", "pallas_blackwell")


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or inconsistent; the message names the field."""


@dataclasses.dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE extension (DeepSeek-V3 flavour, including the softmax-scale mscale adjustment)."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


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
    # Router replay: a replayed expert is kept only if the trainer's score for it is at least this
    # times the trainer's k-th best score (0 keeps every replayed expert).
    replay_min_ratio: float = 0.0
    # Expert grouped GEMM: "bf16" (compute dtype), "mxfp8", or "nvfp4_fwd_mxfp8_bwd"; and the
    # backend that runs the low-precision recipes.
    expert_precision: str = "bf16"
    expert_backend: str = "reference"
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

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Physical mesh axis sizes; -1 on one axis means 'all remaining devices'."""

    replica: int = 1
    fsdp: int = -1
    cp: int = 1


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    # Muon (name="muon"): matrices get orthogonalised momentum, everything else AdamW above.
    muon_learning_rate: float = 0.02
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_scaling: str = "rms"  # "rms": 0.2*sqrt(max(A, B)) (AdamW-matched); "spectral"
    qk_clip_threshold: float = 0.0  # MuonClip for MLA: 0 disables


@dataclasses.dataclass(frozen=True)
class DataConfig:
    tokenizer: str = "byte"
    corpus_root: str = ""  # Empty: the running interpreter's standard library.
    extensions: tuple[str, ...] = (".py",)
    eval_fraction: float = 0.02


@dataclasses.dataclass(frozen=True)
class PhaseConfig:
    """One stage of training; phases run in order and split `ExperimentConfig.steps` by fraction."""

    name: str = "main"
    fraction: float = 1.0
    seq_len: int = 128
    batch_size: int = 8
    lr_scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    phases: tuple[PhaseConfig, ...] = (PhaseConfig(),)
    mtp_weight: float = 0.3
    mtp_loss: str = (
        "distill"  # "distill": KL to the main head's (stop-gradient) logits; "ce": labels.
    )
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 50
    keep_checkpoints: int = 2


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    optim: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    steps: int = 200
    seed: int = 0
    workdir: str = "runs/default"
    # Hugging Face DeepSeek-V3-format folder whose weights start a fresh run (continued
    # pretraining); its architecture must match `model`. Ignored when the workdir has a checkpoint.
    init_from: str = ""


# ----------------------------------------------------------------------------- conversion


def to_dict(cfg: Any) -> Any:
    """Dataclass tree -> plain dicts/lists (tuples of dataclasses become lists of dicts)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (tuple, list)):
        return [to_dict(v) for v in cfg]
    return cfg


def _convert(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} does not fit {annotation}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a sequence, got {value!r}")
        (item_type, _) = typing.get_args(annotation)
        return tuple(_convert(v, item_type, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, where)
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if annotation in (bool, str):
        if not isinstance(value, annotation):
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported annotation {annotation}")


def from_dict(cls: type, data: Any, where: str = "config") -> Any:
    """Rebuilds dataclass `cls` from nested mappings, naming any unknown field or mistyped value."""
    if dataclasses.is_dataclass(data):
        data = to_dict(data)
    if hasattr(data, "to_dict"):  # ml_collections.ConfigDict
        data = data.to_dict()
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{where}.{unknown[0]}: unknown field of {cls.__name__} "
            f"(known: {', '.join(sorted(known))})"
        )
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    return cls(**kwargs)


# ----------------------------------------------------------------------------- validation


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field}: {message}")


def validate_model(m: ModelConfig, where: str = "model") -> None:
    """Rejects shapes the model cannot build, naming the field at fault."""
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
    _check(m.num_shared_experts >= 0, f"{where}.num_shared_experts", "must be >= 0")
    _check(m.num_mtp_layers >= 0, f"{where}.num_mtp_layers", "must be >= 0")
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
    _check(0 <= m.replay_min_ratio <= 1, f"{where}.replay_min_ratio", "must lie in [0, 1]")
    if m.rope_scaling is not None:
        _check(m.rope_scaling.factor >= 1.0, f"{where}.rope_scaling.factor", "must be >= 1")
        _check(
            m.rope_scaling.beta_fast > m.rope_scaling.beta_slow,
            f"{where}.rope_scaling.beta_fast",
            "must exceed beta_slow",
        )


def validate(cfg: ExperimentConfig, num_devices: int | None = None) -> None:
    """Checks the whole experiment; with `num_devices`, also that the mesh and batches fit it."""
    validate_model(cfg.model)
    _check(cfg.steps > 0, "steps", f"must be positive, got {cfg.steps}")
    o = cfg.optim
    _check(o.name in ("adamw", "muon"), "optim.name", f"unknown optimizer {o.name!r}")
    _check(
        o.muon_scaling in ("rms", "spectral"),
        "optim.muon_scaling",
        f"must be 'rms' or 'spectral', got {o.muon_scaling!r}",
    )
    _check(o.muon_ns_steps > 0, "optim.muon_ns_steps", "must be positive")
    _check(o.learning_rate > 0, "optim.learning_rate", "must be positive")
    _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must lie in [0, 1]")
    _check(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    _check(o.clip_norm > 0, "optim.clip_norm", "must be positive")
    t = cfg.train
    _check(len(t.phases) > 0, "train.phases", "needs at least one phase")
    total = sum(p.fraction for p in t.phases)
    _check(abs(total - 1.0) < 1e-6, "train.phases", f"fractions must sum to 1, got {total}")
    for i, p in enumerate(t.phases):
        _check(p.fraction > 0, f"train.phases[{i}].fraction", "must be positive")
        _check(p.seq_len > 1, f"train.phases[{i}].seq_len", "must be > 1")
        _check(p.batch_size > 0, f"train.phases[{i}].batch_size", "must be positive")
    _check(t.mtp_loss in ("distill", "ce"), "train.mtp_loss", f"unknown MTP loss {t.mtp_loss!r}")
    for name in ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "eval_batches"):
        _check(getattr(t, name) > 0, f"train.{name}", "must be positive")
    _check(0 < cfg.data.eval_fraction < 1, "data.eval_fraction", "must lie in (0, 1)")
    if num_devices is not None:
        shape = mesh_shape(cfg.mesh, num_devices)
        data_parallel = shape["replica"] * shape["fsdp"]
        for i, p in enumerate(t.phases):
            _check(
                p.batch_size % data_parallel == 0,
                f"train.phases[{i}].batch_size",
                f"{p.batch_size} is not divisible by replica*fsdp={data_parallel}",
            )
            _check(
                p.seq_len % (2 * shape["cp"]) == 0 or shape["cp"] == 1,
                f"train.phases[{i}].seq_len",
                f"{p.seq_len} must be divisible by 2*cp={2 * shape['cp']} for load-balanced CP",
            )


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


def phase_steps(cfg: ExperimentConfig) -> list[int]:
    """Steps per phase: fractions of `cfg.steps`, rounded so that they add up exactly."""
    bounds = [0]
    acc = 0.0
    for p in cfg.train.phases:
        acc += p.fraction
        bounds.append(round(acc * cfg.steps))
    bounds[-1] = cfg.steps
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


# ----------------------------------------------------------------------------- presets


def tiny() -> ExperimentConfig:
    """Runs in minutes on a laptop CPU: 3 phases (main, long context, short SFT-length)."""
    return ExperimentConfig(
        model=ModelConfig(),
        train=TrainConfig(
            phases=(
                PhaseConfig("main", fraction=0.7, seq_len=128, batch_size=8),
                PhaseConfig("long_context", fraction=0.2, seq_len=256, batch_size=4, lr_scale=0.5),
                PhaseConfig("sft", fraction=0.1, seq_len=64, batch_size=16, lr_scale=0.25),
            ),
            eval_every=50,
            checkpoint_every=50,
        ),
        steps=300,
        workdir="runs/tiny",
    )


def small() -> ExperimentConfig:
    """About 100M total parameters: a single-GPU model for real ablations."""
    model = ModelConfig(
        vocab_size=259,
        hidden_size=512,
        num_layers=8,
        first_k_dense=1,
        num_heads=8,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        intermediate_size=2048,
        moe_intermediate_size=256,
        num_experts=32,
        num_experts_per_tok=6,
        num_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        max_position_embeddings=32768,
        num_mtp_layers=1,
    )
    return ExperimentConfig(
        model=model,
        optim=OptimizerConfig(learning_rate=1e-3, warmup_steps=500),
        train=TrainConfig(
            phases=(
                PhaseConfig("main", fraction=0.8, seq_len=2048, batch_size=64),
                PhaseConfig(
                    "long_context", fraction=0.15, seq_len=8192, batch_size=16, lr_scale=0.3
                ),
                PhaseConfig("sft", fraction=0.05, seq_len=2048, batch_size=64, lr_scale=0.1),
            ),
            log_every=20,
            eval_every=500,
            checkpoint_every=500,
        ),
        steps=20000,
        workdir="runs/small",
    )


def kimi_k2_model() -> ModelConfig:
    """The Kimi-K2 shape (1.04T total / 32B active); used for accounting, never allocated."""
    return ModelConfig(
        vocab_size=163840,
        hidden_size=7168,
        num_layers=61,
        first_k_dense=1,
        num_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope_theta=50000.0,
        rope_scaling=YarnConfig(
            factor=32.0,
            original_max_position_embeddings=4096,
            beta_fast=1.0 * 32,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_position_embeddings=131072,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_experts=384,
        num_experts_per_tok=8,
        num_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        num_mtp_layers=0,
    )


def kimi_k2() -> ExperimentConfig:
    return ExperimentConfig(
        model=kimi_k2_model(),
        mesh=MeshConfig(replica=-1, fsdp=64, cp=2),
        train=TrainConfig(
            phases=(
                PhaseConfig("main", fraction=0.9, seq_len=32768, batch_size=512),
                PhaseConfig(
                    "long_context", fraction=0.08, seq_len=262144, batch_size=64, lr_scale=0.3
                ),
                PhaseConfig("sft", fraction=0.02, seq_len=32768, batch_size=512, lr_scale=0.1),
            )
        ),
        steps=100000,
        workdir="runs/kimi_k2",
    )


PRESETS = {"tiny": tiny, "small": small, "kimi_k2": kimi_k2}
