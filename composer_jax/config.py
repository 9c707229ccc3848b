"""Typed experiment configuration: frozen dataclasses are the source of truth.

`launch/` turns these into `ml_collections.ConfigDict`s so every field can be overridden from the
command line (`--config.model.num_layers=4`), then rebuilds the dataclasses with `from_dict`, which
rejects unknown fields and wrong types, and `validate`, which rejects contradictory values. Both
name the offending field and run before anything is compiled. Presets: `composer_jax.presets`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

EXPERT_PRECISIONS = ("bf16", "mxfp8", "nvfp4_fwd_mxfp8_bwd")
EXPERT_BACKENDS = ("reference", "pallas_hopper", "pallas_blackwell")
EXPERT_GEMM_IMPLS = ("auto", "ragged_dot", "tiled")


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
    or "auto" (ragged on GPU, padded elsewhere).
    """

    replica: int = 1
    fsdp: int = -1
    cp: int = 1
    ep: tuple[str, ...] = ("fsdp", "cp")
    ep_quantize: str = "auto"
    ep_dispatch: str = "auto"


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
    # Built-in coding tasks (SFT phases, RL prompts, held-out evaluation) chain at most this many
    # transforms (1..3): fewer make an easier family for small models.
    task_max_ops: int = 3


@dataclasses.dataclass(frozen=True)
class PhaseConfig:
    """One stage of training; phases run in order and split `ExperimentConfig.steps` by fraction.

    `data`: "corpus" (packed source files, every token a target) or "builtin_tasks" (SFT on the
    built-in coding tasks: prompt -> the agent's oracle turn, loss on the turn only).
    """

    name: str = "main"
    fraction: float = 1.0
    seq_len: int = 128
    batch_size: int = 8
    lr_scale: float = 1.0
    data: str = "corpus"


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


KL_ESTIMATORS = ("k1", "k2", "k3", "exact")
KL_PLACEMENTS = ("in_reward", "in_loss")
IMPORTANCE_WEIGHTINGS = ("none", "truncated", "ppo_clip")
ADVANTAGE_MODES = ("mean", "mean_std", "leave_one_out")


@dataclasses.dataclass(frozen=True)
class RLObjectiveConfig:
    """Group policy gradient with KL, length penalty and text-feedback distillation."""

    # KL(pi || pi_ref): "k1" log(pi/ref), "k2" (log ratio)^2/2, "k3" (r - 1) - log r with
    # r = ref/pi, or "exact" (full-vocabulary KL per position from the logits; in_loss only).
    # "in_reward": -kl_coef * estimate folded into the sample's reward (stop-gradient; reaches the
    # policy through the score function). "in_loss": added as a differentiable loss (ablation).
    kl_estimator: str = "k1"
    kl_placement: str = "in_reward"
    kl_coef: float = 1e-3
    # Importance weight between the trainer's log-probs and the sampler's: "none", "truncated"
    # (stop-gradient ratio capped at importance_cap) or "ppo_clip" (ratio clipped to
    # [1 - clip_eps_low, 1 + clip_eps_high], pessimistic surrogate).
    importance_weighting: str = "truncated"
    importance_cap: float = 2.0
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    # Token losses are summed and divided by a constant, never by a sequence's length:
    # loss_normalizer, or (when 0) the batch's sample slots (groups * G) * max_generation_len.
    loss_normalizer: float = 0.0
    max_generation_len: int = 1024
    # Advantage = reward - group mean ("mean", Dr. GRPO); "mean_std" also divides by the group's
    # std + advantage_std_eps; "leave_one_out" subtracts the mean of the *other* samples.
    advantage_mode: str = "mean"
    advantage_std_eps: float = 1e-6
    # Length penalty coef * C(x), C(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)) (log(1 + k x) / k at
    # q = 1), x = weighted sum of the sample's token counts by kind, tool calls and turns.
    length_penalty_coef: float = 1e-3
    length_penalty_k: float = 1e-3
    length_penalty_q: float = 1.5
    length_weight_thinking: float = 1.0
    length_weight_tool_call: float = 1.0
    length_weight_tool_output: float = 0.5
    length_weight_final_message: float = 1.0
    length_weight_summary: float = 1.0
    length_weight_per_tool_call: float = 0.0
    length_weight_per_turn: float = 0.0
    # Text-feedback distillation: coefficient of KL(student || hinted teacher) on flagged turns.
    distill_coef: float = 0.1
    # Router replay: force the sampler's experts in the trainer's forward (the plausibility ratio
    # is the model's `replay_min_ratio`, since it changes the model's routing).
    router_replay: bool = True


RL_BACKENDS = ("threads", "ray")
ENV_WORKER_KINDS = ("process", "thread")
STALE_POLICIES = ("drop", "reweight")
HELDOUT_SPLITS = ("functions", "instances")


@dataclasses.dataclass(frozen=True)
class RLConfig(RLObjectiveConfig):
    """The RL objective plus the asynchronous actor loop that feeds it (`launch/rl.py`)."""

    # Roles: "threads" runs trainer, sampler, environments and evaluator in one process; "ray"
    # runs the sampler and the environment workers as Ray actors (multi-host rollouts).
    backend: str = "threads"
    env_workers: str = "process"  # threads backend: environment workers as processes or threads
    num_env_workers: int = 2
    # A step slower than this counts as a hung worker; 0 derives it from the environment's
    # limits (the longest a turn of commands plus grading may legitimately take).
    env_timeout_s: float = 0.0
    # Model-written code runs only in an isolating sandbox (bubblewrap or util-linux unshare);
    # False allows the unisolated fallback, for quick local experiments.
    require_sandbox: bool = True
    # Scheduling: one epoch over `num_prompts` distinct training tasks (0: steps x groups_per_step),
    # `group_size` samples each; a step trains on `groups_per_step` finished groups.
    group_size: int = 4
    groups_per_step: int = 4
    num_prompts: int = 0
    # A group's oldest token may lag the trained policy by at most `max_staleness` versions; older
    # groups are dropped or have their advantages scaled by stale_decay ** (lag - max_staleness).
    max_staleness: int = 2
    stale_policy: str = "drop"
    stale_decay: float = 0.5
    # Dynamic sampling (DAPO): skip groups whose samples all got the same task reward (their
    # advantages carry only the KL and length terms); they are counted, their prompts not redone.
    skip_uniform_groups: bool = False
    # Later in the epoch, revisit the hardest prompts seen (most turns, then most thinking tokens):
    # this fraction of the scheduled groups is drawn from them once half the prompts are used.
    hard_prompt_fraction: float = 0.0
    # Sampling.
    num_slots: int = 16
    context_len: int = 768
    max_new_tokens: int = 256  # per turn
    max_turns: int = 2
    temperature: float = 1.0
    top_p: float = 1.0
    recompute_cache_on_update: bool = False
    # Self-summarisation: when a generation's context reaches summary_budget tokens (0: off), the
    # policy writes a summary and continues from system prompt + task + summary.
    summary_budget: int = 0
    max_summaries: int = 4
    summary_max_tokens: int = 128
    # Text feedback: detectors that flag turns and build the hint of the teacher context.
    feedback_detectors: tuple[str, ...] = (
        "unknown_tool",
        "invalid_arguments",
        "ignored_tool_error",
        "style",
    )
    # Weight sync from trainer to sampler ("" : <workdir>/weights); deltas "xor" or "add".
    weight_store: str = ""
    weight_delta: str = "xor"
    snapshot_every: int = 8
    # Warm start: a pretraining workdir whose latest checkpoint starts RL, or, when empty, a run
    # of the experiment's train.phases (e.g. SFT on the built-in tasks) for warm_start_steps steps
    # at warm_start_lr (in <workdir>/warm_start).
    warm_start: str = ""
    warm_start_steps: int = 300
    warm_start_lr: float = 3e-3
    # Held-out evaluation before RL and at the end: tasks x samples each. "functions": the task
    # family's held-out split (functions never trained on); "instances": fresh tasks of training
    # functions (seeds used by neither the warm start nor the RL prompts).
    heldout_split: str = "functions"
    heldout_tasks: int = 32
    heldout_samples: int = 2
    heldout_temperature: float = 1.0


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    optim: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    rl: RLConfig = RLConfig()
    steps: int = 200
    seed: int = 0
    workdir: str = "runs/default"
    # Hugging Face DeepSeek-V3-format folder whose weights start a fresh run (continued
    # pretraining); its architecture must match `model`. Ignored when the workdir has a checkpoint.
    init_from: str = ""
    print_sharding: bool = False  # print every parameter's resolved sharding at start-up


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
    _check(0 <= m.replay_min_ratio <= 1, f"{where}.replay_min_ratio", "must lie in [0, 1]")
    if m.rope_scaling is not None:
        _check(m.rope_scaling.factor >= 1.0, f"{where}.rope_scaling.factor", "must be >= 1")
        _check(
            m.rope_scaling.beta_fast > m.rope_scaling.beta_slow,
            f"{where}.rope_scaling.beta_fast",
            "must exceed beta_slow",
        )


def validate_rl_objective(cfg: RLObjectiveConfig, where: str = "rl") -> None:
    """Rejects unknown choices and out-of-range values, naming the field."""
    choices = (
        ("kl_estimator", KL_ESTIMATORS),
        ("kl_placement", KL_PLACEMENTS),
        ("importance_weighting", IMPORTANCE_WEIGHTINGS),
        ("advantage_mode", ADVANTAGE_MODES),
    )
    for name, allowed in choices:
        value = getattr(cfg, name)
        _check(value in allowed, f"{where}.{name}", f"{value!r} is not one of {allowed}")
    _check(
        not (cfg.kl_estimator == "exact" and cfg.kl_placement == "in_reward"),
        f"{where}.kl_placement",
        "the exact KL is a per-position expectation: use it with 'in_loss'",
    )
    non_negative = (
        "kl_coef",
        "loss_normalizer",
        "length_penalty_coef",
        "length_penalty_q",
        "distill_coef",
        "length_weight_thinking",
        "length_weight_tool_call",
        "length_weight_tool_output",
        "length_weight_final_message",
        "length_weight_summary",
        "length_weight_per_tool_call",
        "length_weight_per_turn",
    )
    for name in non_negative:
        _check(getattr(cfg, name) >= 0, f"{where}.{name}", "must be >= 0")
    positive = ("importance_cap", "advantage_std_eps", "length_penalty_k", "max_generation_len")
    for name in positive:
        _check(getattr(cfg, name) > 0, f"{where}.{name}", "must be > 0")
    _check(0 <= cfg.clip_eps_low < 1, f"{where}.clip_eps_low", "must lie in [0, 1)")
    _check(cfg.clip_eps_high >= 0, f"{where}.clip_eps_high", "must be >= 0")


def validate_rl(cfg: RLConfig, where: str = "rl") -> None:
    """The objective's checks plus the actor loop's."""
    validate_rl_objective(cfg, where)
    for name, allowed in (
        ("backend", RL_BACKENDS),
        ("env_workers", ENV_WORKER_KINDS),
        ("stale_policy", STALE_POLICIES),
        ("weight_delta", ("xor", "add")),
        ("heldout_split", HELDOUT_SPLITS),
    ):
        value = getattr(cfg, name)
        _check(value in allowed, f"{where}.{name}", f"{value!r} is not one of {allowed}")
    for name in (
        "num_env_workers",
        "group_size",
        "groups_per_step",
        "num_slots",
        "context_len",
        "max_new_tokens",
        "max_turns",
        "summary_max_tokens",
        "snapshot_every",
        "warm_start_steps",
        "heldout_tasks",
        "heldout_samples",
    ):
        _check(getattr(cfg, name) > 0, f"{where}.{name}", "must be positive")
    for name in ("num_prompts", "max_staleness", "summary_budget", "max_summaries"):
        _check(getattr(cfg, name) >= 0, f"{where}.{name}", "must be >= 0")
    _check(cfg.env_timeout_s >= 0, f"{where}.env_timeout_s", "must be >= 0 (0: derived)")
    _check(0 < cfg.stale_decay <= 1, f"{where}.stale_decay", "must lie in (0, 1]")
    _check(0 <= cfg.hard_prompt_fraction < 1, f"{where}.hard_prompt_fraction", "must lie in [0, 1)")
    _check(cfg.temperature > 0, f"{where}.temperature", "RL samples: must be > 0")
    _check(0 < cfg.top_p <= 1, f"{where}.top_p", "must lie in (0, 1]")
    _check(cfg.heldout_temperature >= 0, f"{where}.heldout_temperature", "must be >= 0")
    _check(
        cfg.group_size <= cfg.num_slots,
        f"{where}.group_size",
        f"a group ({cfg.group_size}) must fit in the sampler's num_slots ({cfg.num_slots})",
    )
    _check(
        cfg.summary_budget == 0 or cfg.summary_budget + cfg.summary_max_tokens < cfg.context_len,
        f"{where}.summary_budget",
        "summary_budget + summary_max_tokens must be below context_len",
    )


def validate(cfg: ExperimentConfig, num_devices: int | None = None) -> None:
    """Checks the whole experiment; with `num_devices`, also that the mesh and batches fit it."""
    validate_model(cfg.model)
    validate_rl(cfg.rl)
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
        _check(
            p.data in ("corpus", "builtin_tasks"),
            f"train.phases[{i}].data",
            f"must be 'corpus' or 'builtin_tasks', got {p.data!r}",
        )
    _check(t.mtp_loss in ("distill", "ce"), "train.mtp_loss", f"unknown MTP loss {t.mtp_loss!r}")
    for name in ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "eval_batches"):
        _check(getattr(t, name) > 0, f"train.{name}", "must be positive")
    _check(0 < cfg.data.eval_fraction < 1, "data.eval_fraction", "must lie in (0, 1)")
    _check(1 <= cfg.data.task_max_ops <= 3, "data.task_max_ops", "must lie in [1, 3]")
    for axis in cfg.mesh.ep:
        _check(axis in ("replica", "fsdp", "cp"), "mesh.ep", f"unknown mesh axis {axis!r}")
    _check(len(set(cfg.mesh.ep)) == len(cfg.mesh.ep), "mesh.ep", "repeats an axis")
    _check(
        cfg.mesh.ep_quantize in ("auto", "mxfp8", "none"),
        "mesh.ep_quantize",
        f"must be auto, mxfp8 or none, got {cfg.mesh.ep_quantize!r}",
    )
    _check(
        cfg.mesh.ep_dispatch in ("auto", "ragged", "padded", "ragged_emulated"),
        "mesh.ep_dispatch",
        f"must be auto, ragged, padded or ragged_emulated, got {cfg.mesh.ep_dispatch!r}",
    )
    _check(
        cfg.mesh.ep_quantize == "none" or cfg.model.hidden_size % 32 == 0,
        "mesh.ep_quantize",
        f"MXFP8 dispatch needs model.hidden_size divisible by 32, got {cfg.model.hidden_size}",
    )
    if num_devices is not None:
        shape = mesh_shape(cfg.mesh, num_devices)
        ep_size = 1
        for axis in cfg.mesh.ep:
            ep_size *= shape[axis]
        _check(
            cfg.model.num_experts % ep_size == 0,
            "mesh.ep",
            f"the expert-parallel group {cfg.mesh.ep} has {ep_size} devices, which does not "
            f"divide model.num_experts={cfg.model.num_experts}",
        )
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


# Presets live in their own module; re-exported so `config.tiny()` reads naturally.
from composer_jax.presets import (  # noqa: E402, F401
    PRESETS,
    kimi_k2,
    kimi_k2_model,
    rl_small,
    rl_tiny,
    small,
    tiny,
)
