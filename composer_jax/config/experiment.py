"""One experiment: the model, mesh, optimizer, data, training phases and RL settings, and the
checks that reject contradictory values before anything compiles."""

from __future__ import annotations

import dataclasses

from composer_jax.config.base import check as _check
from composer_jax.config.model import (
    MeshConfig,
    ModelConfig,
    ep_group_size,
    mesh_shape,
    validate_model,
)
from composer_jax.config.rl import RLConfig, validate_rl
from composer_jax.config.training import (
    LR_SCHEDULES,
    DataConfig,
    LogConfig,
    OptimizerConfig,
    TrainConfig,
)

SFT_STYLES = ("first_turn", "episode")

RESUME_POLICIES = ("auto", "never", "must")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    optim: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    rl: RLConfig = RLConfig()
    log: LogConfig = LogConfig()
    steps: int = 200
    seed: int = 0
    workdir: str = "runs/default"
    # Hugging Face DeepSeek-V3-format folder whose weights start a fresh run (continued
    # pretraining); its architecture must match `model`. Ignored when the workdir has a checkpoint.
    init_from: str = ""
    print_sharding: bool = False  # print every parameter's resolved sharding at start-up
    # On a workdir that already holds a run: "auto" resumes it when its stored config equals this
    # one (else stops, listing the differing fields), "never" refuses to start there, "must"
    # refuses to start fresh and also lets `steps` grow (an explicit extension).
    resume: str = "auto"


def validate(cfg: ExperimentConfig, num_devices: int | None = None) -> None:
    """Checks the whole experiment; with `num_devices`, also that the mesh and batches fit it."""
    validate_model(cfg.model)
    validate_rl(cfg.rl)
    _check(cfg.steps > 0, "steps", f"must be positive, got {cfg.steps}")
    _check(
        cfg.resume in RESUME_POLICIES,
        "resume",
        f"must be one of {', '.join(RESUME_POLICIES)}, got {cfg.resume!r}",
    )
    _check_optim(cfg.optim)
    _check_training(cfg)
    _check(
        len(set(cfg.log.trackers)) == len(cfg.log.trackers) and all(cfg.log.trackers),
        "log.trackers",
        f"names each tracker once, got {cfg.log.trackers}",
    )
    _check_mesh(cfg)
    if num_devices is not None:
        _check_fits(cfg, num_devices)


def _check_optim(o: OptimizerConfig) -> None:
    _check(o.name in ("adamw", "muon"), "optim.name", f"unknown optimizer {o.name!r}")
    _check(
        o.muon_scaling in ("rms", "spectral"),
        "optim.muon_scaling",
        f"must be 'rms' or 'spectral', got {o.muon_scaling!r}",
    )
    _check(o.muon_ns_steps > 0, "optim.muon_ns_steps", "must be positive")
    _check(o.learning_rate > 0, "optim.learning_rate", "must be positive")
    _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must lie in [0, 1]")
    _check(
        o.schedule in LR_SCHEDULES,
        "optim.schedule",
        f"must be one of {', '.join(LR_SCHEDULES)}, got {o.schedule!r}",
    )
    _check(0 < o.decay_fraction <= 1, "optim.decay_fraction", "must lie in (0, 1]")
    _check(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    _check(o.clip_norm > 0, "optim.clip_norm", "must be positive")
    _check(
        0 <= o.qk_clip_threshold < float("inf"),
        "optim.qk_clip_threshold",
        f"must be a finite logit >= 0 (0 disables QK-clip), got {o.qk_clip_threshold}",
    )


def _check_training(cfg: ExperimentConfig) -> None:
    """The phases, the training loop's periods and the data fields."""
    t = cfg.train
    _check(len(t.phases) > 0, "train.phases", "needs at least one phase")
    total = sum(p.fraction for p in t.phases)
    _check(abs(total - 1.0) < 1e-6, "train.phases", f"fractions must sum to 1, got {total}")
    for i, p in enumerate(t.phases):
        _check(p.fraction > 0, f"train.phases[{i}].fraction", "must be positive")
        _check(p.seq_len > 1, f"train.phases[{i}].seq_len", "must be > 1")
        _check(p.batch_size > 0, f"train.phases[{i}].batch_size", "must be positive")
        _check(p.microbatches > 0, f"train.phases[{i}].microbatches", "must be positive")
        _check(
            p.data in ("corpus", "tasks"),
            f"train.phases[{i}].data",
            f"must be 'corpus' or 'tasks', got {p.data!r}",
        )
    _check(t.mtp_loss in ("distill", "ce"), "train.mtp_loss", f"unknown MTP loss {t.mtp_loss!r}")
    for name in ("log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "eval_batches"):
        _check(getattr(t, name) > 0, f"train.{name}", "must be positive")
    _check(0 < cfg.data.eval_fraction < 1, "data.eval_fraction", "must lie in (0, 1)")
    _check(bool(cfg.data.tasks.strip()), "data.tasks", "must name a task source")
    _check(
        cfg.data.sft_style in SFT_STYLES,
        "data.sft_style",
        f"{cfg.data.sft_style!r} is not one of {SFT_STYLES}",
    )
    _check(cfg.data.sft_tasks > 0, "data.sft_tasks", "must be positive")
    _check(0 <= cfg.data.sft_feedback <= 1, "data.sft_feedback", "must lie in [0, 1]")
    _check(
        cfg.data.sft_feedback == 0 or cfg.data.sft_style == "episode",
        "data.sft_feedback",
        "needs data.sft_style 'episode' (the mistakes are made in scripted episodes)",
    )
    _check(0 <= cfg.data.sft_repairs <= 1, "data.sft_repairs", "must lie in [0, 1]")
    _check(
        cfg.data.sft_repairs == 0 or cfg.data.sft_style == "episode",
        "data.sft_repairs",
        "needs data.sft_style 'episode' (the repairs are made in scripted episodes)",
    )
    _check(bool(cfg.data.text_field), "data.text_field", "must name a field")


def _check_mesh(cfg: ExperimentConfig) -> None:
    """The expert-parallel axes and their dispatch."""
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
        cfg.mesh.ep_capacity is None or 0 < cfg.mesh.ep_capacity < float("inf"),
        "mesh.ep_capacity",
        f"must be None (dropless) or a positive number, got {cfg.mesh.ep_capacity!r}",
    )
    _check(
        cfg.mesh.ep_quantize == "none" or cfg.model.hidden_size % 32 == 0,
        "mesh.ep_quantize",
        f"MXFP8 dispatch needs model.hidden_size divisible by 32, got {cfg.model.hidden_size}",
    )


def _check_fits(cfg: ExperimentConfig, num_devices: int) -> None:
    """The mesh on `num_devices`: experts split evenly, batches and CP chunks divide."""
    mesh = fitted_mesh(cfg, num_devices)
    shape = mesh_shape(mesh, num_devices)
    ep_size = ep_group_size(mesh, num_devices)
    _check(
        cfg.model.num_experts % ep_size == 0,
        "mesh.ep",
        f"the expert-parallel group {cfg.mesh.ep} has {ep_size} devices, which does not "
        f"divide model.num_experts={cfg.model.num_experts}",
    )
    data_parallel = shape["replica"] * shape["fsdp"]
    for i, p in enumerate(cfg.train.phases):
        _check(
            p.batch_size % (data_parallel * p.microbatches) == 0,
            f"train.phases[{i}].batch_size",
            f"{p.batch_size} is not divisible by replica*fsdp={data_parallel}"
            + (f" x microbatches={p.microbatches}" if p.microbatches > 1 else ""),
        )
        _check(
            p.seq_len % (2 * shape["cp"]) == 0 or shape["cp"] == 1,
            f"train.phases[{i}].seq_len",
            f"{p.seq_len} must be divisible by 2*cp={2 * shape['cp']} for load-balanced CP",
        )


def fitted_mesh(cfg: ExperimentConfig, num_devices: int) -> MeshConfig:
    """`cfg.mesh` with every axis resolved for `num_devices`, the free axis fitted to the batches.

    The batch shards over replica x fsdp, so a phase whose batch does not divide by them cannot
    run (tiny's long-context batch of 4 on 8 devices). When fsdp is the free axis and cp is 1,
    fsdp takes the largest share of its devices that divides every phase's batch and context
    parallelism the rest (when every phase's sequence splits into 2*cp chunks). Batches stay
    as configured, so the optimisation (and every loss) is the same on any device count; parameter
    and expert sharding cover the same devices either way (dense and expert state shard over
    (fsdp, cp) together); only the activations' split changes, and CP is what long phases want.
    Any other mesh is only resolved; `validate` then names what does not fit.
    """
    shape = mesh_shape(cfg.mesh, num_devices)
    if cfg.mesh.fsdp == -1 and cfg.mesh.cp == 1:
        phases = cfg.train.phases
        for fsdp in range(shape["fsdp"], 0, -1):
            cp = shape["fsdp"] // fsdp
            if (
                shape["fsdp"] % fsdp == 0
                and all(p.batch_size % (shape["replica"] * fsdp) == 0 for p in phases)
                and all(p.seq_len % (2 * cp) == 0 or cp == 1 for p in phases)
            ):
                shape = dict(shape, fsdp=fsdp, cp=cp)
                break
    return dataclasses.replace(cfg.mesh, **shape)


def phase_steps(cfg: ExperimentConfig) -> list[int]:
    """Steps per phase: fractions of `cfg.steps`, rounded so that they add up exactly."""
    bounds = [0]
    acc = 0.0
    for p in cfg.train.phases:
        acc += p.fraction
        bounds.append(round(acc * cfg.steps))
    bounds[-1] = cfg.steps
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]
