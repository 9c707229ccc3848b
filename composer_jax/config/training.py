"""Optimizer, data and the phases of training."""

from __future__ import annotations

import dataclasses

LR_SCHEDULES = ("cosine", "wsd")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer (AdamW, or Muon for matrices with AdamW for the rest), its schedule and clip."""

    name: str = "adamw"
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    # After the warm-up: "cosine" decays from the peak to min_lr_ratio x peak over the rest of the
    # run; "wsd" (warmup-stable-decay, as DeepSeek-V3 and Kimi K2) holds the peak, then decays by
    # cosine over the run's last `decay_fraction` of the steps after the warm-up.
    schedule: str = "cosine"
    decay_fraction: float = 0.2
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
    # QK-clip (Kimi K2's MuonClip, with either optimizer): after each update, the heads whose
    # largest attention logit in the step's forward passed this are scaled back to it. 0: off.
    qk_clip_threshold: float = 0.0


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The tokenizer, the documents pretraining reads and the coding tasks SFT and RL use."""

    # "auto" (the init_from checkpoint's tokenizer when its folder has one, else the RL warm
    # start run's, else "byte"), "byte", a tokenizer shipped in composer_jax/data/tokenizers/, or
    # a folder with tokenizer.json (HF) or tiktoken.model. Saved with the run.
    tokenizer: str = "auto"
    # Empty: the running interpreter's standard library. A folder of code, or JSONL / Parquet /
    # ArrayRecord documents (a file or a folder of them; the text in `text_field`).
    corpus_root: str = ""
    text_field: str = "text"
    extensions: tuple[str, ...] = (".py",)
    eval_fraction: float = 0.02
    # The coding tasks of SFT phases: a task source spec (`composer_jax.envs.load_task_source`:
    # builtin[:max_ops=N], builtin_repo, repositories, humaneval, jsonl:PATH, a weighted mixture
    # a:0.7,b:0.3, or pkg.module:function). RL prompts and held-out evaluation default to it.
    tasks: str = "builtin"
    # What an SFT phase learns from its first `sft_tasks` training tasks (those with an oracle
    # solution): "first_turn" (the first observation -> a turn writing the solution) or
    # "episode" (the scripted agent's whole episode played through the RL workflow in the real
    # environment, with rl.*'s tools, turns and summaries: find, read, plan, edit, test, report;
    # every generation an example, the loss on the agent's tokens; `composer_jax.agent.sft`).
    sft_style: str = "first_turn"
    sft_tasks: int = 2000
    # "episode" only: the share of scripted episodes that make one mistake a feedback detector
    # flags before the call they meant (`agent.oracle.MISTAKES`). The mistake is not learned;
    # the detector's hint followed by the right call is, so the hinted teacher that feedback
    # distillation trains toward has learned to act on what its hint says.
    sft_feedback: float = 0.0
    # "episode" only: the share of tasks that, beside their clean episode, have one whose first
    # edit is wrong (one line of the solution changed: `agent.oracle.wrong_body`), so the
    # visible tests fail and the script fixes that line, tests again and reports
    # (`agent.oracle.OracleScript`'s `repair_rng`). The wrong edit is not learned; what follows
    # a failing test is.
    sft_repairs: float = 0.0


@dataclasses.dataclass(frozen=True)
class PhaseConfig:
    """One stage of training; phases run in order and split `ExperimentConfig.steps` by fraction.

    `data`: "corpus" (packed source files, every token a target) or "tasks" (SFT on the coding
    tasks of `data.tasks`: first observation -> the agent's oracle turn, loss on the turn only).
    """

    name: str = "main"
    fraction: float = 1.0
    seq_len: int = 128
    batch_size: int = 8
    lr_scale: float = 1.0
    data: str = "corpus"
    # Gradient accumulation: each step's batch runs as this many micro-batches (a forward and a
    # backward each, gradients summed) before one optimizer update; the loss is the whole
    # batch's, so the update is the same as in one pass. Activation memory for step time.
    microbatches: int = 1


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """Where a run's metrics go besides `metrics.jsonl`: any trackers of `train.trackers.TRACKERS`
    (tensorboard, wandb, mlflow, or one registered with `register_tracker`). W&B follows its own settings
    (`WANDB_MODE=offline`, `WANDB_API_KEY`); MLflow writes to `mlflow_uri`: a tracking server
    (http://...), a database (sqlite:///..., with the full `mlflow` package) or a folder; empty
    is `<workdir>/mlruns`. Free to change when a run resumes: the trackers' run ids are kept in
    the workdir, so a resumed run continues the same tracker runs."""

    trackers: tuple[str, ...] = ("tensorboard",)
    wandb_project: str = "composer-jax"
    wandb_entity: str = ""
    mlflow_uri: str = ""
    mlflow_experiment: str = "composer-jax"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The training phases and the step's settings: losses, logging, evaluation, checkpoints."""

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
