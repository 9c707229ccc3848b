"""The RL objective (DESIGN.md section 6) and the actor loop that feeds it (section 7)."""

from __future__ import annotations

import dataclasses
import typing

from composer_jax.config.base import check as _check

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
    # q = 1), x = the report's weighted sum over the whole sample: tokens the policy wrote by kind
    # (thinking, tool calls, final message, summaries: 1 each), tool-output tokens it made the
    # environment produce (0.5: cheaper than writing), and a fixed cost per tool call (25
    # token-equivalents: a call's latency and context) and per turn (50: a round trip).
    length_penalty_coef: float = 1e-3
    length_penalty_k: float = 1e-3
    length_penalty_q: float = 1.5
    length_weight_thinking: float = 1.0
    length_weight_tool_call: float = 1.0
    length_weight_tool_output: float = 0.5
    length_weight_final_message: float = 1.0
    length_weight_summary: float = 1.0
    length_weight_per_tool_call: float = 25.0
    length_weight_per_turn: float = 50.0
    # Text-feedback distillation: coefficient of KL(student || hinted teacher) on flagged turns.
    distill_coef: float = 0.1
    # Router replay: force the sampler's experts in the trainer's forward (the plausibility ratio
    # is the model's `replay_min_ratio`, since it changes the model's routing).
    router_replay: bool = True


RL_BACKENDS = ("threads", "ray")
ENV_WORKER_KINDS = ("process", "thread")
STALE_POLICIES = ("drop", "reweight")
UNIFORM_BY = ("task", "total")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How samples are made: roles and workers, scheduling and staleness, the sampler."""

    # Roles: "threads" runs trainer, sampler, environments and evaluator in one process; "ray"
    # runs the sampler and the environment workers as Ray actors (multi-host rollouts).
    backend: str = "threads"
    env_workers: str = "process"  # threads backend: environment workers as processes or threads
    num_env_workers: int = 2
    # Samplers (each num_slots slots, its own placement group) behind the coordinator, which
    # sends each new request to the least loaded one; more than one needs the ray backend.
    num_samplers: int = 1
    # Ray placement (backend "ray"): GPUs of the sampler's placement group (0: it decodes on CPU,
    # as a CPU-only cluster needs), custom resources ("name=amount,...", as given to `ray start
    # --resources`) that pin the sampler and the environment workers to the nodes having them, and
    # how long an actor may wait for such a node before the start fails naming what it asked for.
    ray_sampler_gpus: float = 0.0
    ray_sampler_resources: str = ""
    ray_env_resources: str = ""
    ray_placement_timeout_s: float = 300.0
    # A step slower than this counts as a hung worker; 0 derives it from the environment's
    # limits (the longest a turn of commands plus grading may legitimately take).
    env_timeout_s: float = 0.0
    # Scheduling: `epochs` passes over `num_prompts` distinct training tasks (0: steps x
    # groups_per_step / epochs, rounded up), each pass in its own order, `group_size` samples a
    # group; a step trains on `groups_per_step` finished groups. A later pass samples a prompt
    # again, as a new group (id p<i>e<pass>), mostly under a policy its earlier groups trained.
    group_size: int = 4
    groups_per_step: int = 4
    num_prompts: int = 0
    epochs: int = 1
    # A group's oldest token may lag the trained policy by at most `max_staleness` versions; older
    # groups are dropped or have their advantages scaled by stale_decay ** (lag - max_staleness).
    max_staleness: int = 2
    stale_policy: str = "drop"
    stale_decay: float = 0.5
    # Dynamic sampling (DAPO): skip groups whose samples all got the same reward; they are
    # counted, their prompts not redone. `uniform_by` "task": the task reward (all pass or all
    # fail: the advantages carry only the length, behaviour and KL terms, which then decide the
    # step); "total": the total reward before KL (the length penalty makes almost every group
    # differ, so almost none is skipped).
    skip_uniform_groups: bool = False
    uniform_by: str = "task"
    # Later in the run, revisit the hardest prompts seen (most turns, then most thinking tokens):
    # this fraction of the scheduled groups is drawn from them once half the prompts are used.
    hard_prompt_fraction: float = 0.0
    # Groups started beyond the sampler's slots: their environments start and their prompts
    # wait in a queue, so a slot that frees is refilled at once instead of idling while a new
    # group's environments start (16 starts on 2 workers: about 0.4 s).
    schedule_ahead_groups: int = 1
    # Sampling: the sampler's slots and context (in tokens), per turn.
    num_slots: int = 16
    context_len: int = 768
    max_new_tokens: int = 256  # per turn
    # The policy trained is the distribution sampled at this temperature (the trainer divides its
    # logits by it too); a top_p nucleus is not reproduced by the trainer (composer_jax.rl.policy).
    temperature: float = 1.0
    top_p: float = 1.0
    recompute_cache_on_update: bool = False
    # Decode steps per jitted engine call (one host sync per call); a weight update lands between
    # calls and a slot freed mid-call takes its next request at the call's end.
    decode_chunk: int = 1
    # Prefill chunk lengths below context_len (which is always the last): a group's prompts
    # prefill as one chunk, and compile one shape, when one bucket holds them all.
    prefill_buckets: tuple[int, ...] = (64, 256)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """The episode the policy plays: workflow, tools, turns, summaries, feedback, behaviour
    rewards (what `composer_jax.agent` reads)."""

    # Its workflow ("builtin", or a factory by import path, module:factory, called with a
    # `composer_jax.agent.WorkflowContext`), the tool profile its training episodes offer (a name
    # in `envs.tools.TOOL_PROFILES` or a comma list of tools) and the held-out check's (empty: the
    # same), and the judge the communication reward asks ("rubric" or module:fn).
    workflow: str = "builtin"
    tools: str = "default"
    eval_tools: str = ""
    communication_judge: str = "rubric"
    max_turns: int = 2
    # Self-summarisation: when a generation's context reaches summary_budget tokens (0: off), the
    # policy writes a summary and continues from system prompt + task + summary.
    summary_budget: int = 0
    max_summaries: int = 4
    summary_max_tokens: int = 128
    # The first observation shows up to this many lines of the task's target function, as an
    # editor's open tab would (0: none; the agent finds and reads it with its tools).
    open_tab_lines: int = 0
    # Text feedback: detectors (`composer_jax.agent.feedback`; or module:Class) that flag turns
    # and build the hint of the teacher context.
    feedback_detectors: tuple[str, ...] = (
        "unknown_tool",
        "tool_unavailable",
        "invalid_arguments",
        "ignored_tool_error",
        "style",
    )
    # Behaviour rewards as "name=weight" (`composer_jax.agent.rewards`: a registered name or a
    # function by import path, module:function), each value in [-1, 0] times its weight: style
    # (share of the added Python lines the AST style monitor flags), tool_misuse (share of tool
    # calls in turns flagged for unknown or unavailable tools, bad arguments or ignored errors),
    # answered (-1 without a final message), harm (a reward-hack monitor's flag; the task reward
    # is already 0 then); also tool_errors (share of failed calls), todo_unfinished (share of the
    # plan left open) and communication (the judge's score of the final message, minus 1).
    behaviour_rewards: tuple[str, ...] = (
        "style=0.05",
        "tool_misuse=0.1",
        "answered=0.05",
        "harm=0.5",
    )
    # Model-written code runs only in an isolating sandbox (bubblewrap or util-linux unshare);
    # False allows the unisolated fallback, for quick local experiments.
    require_sandbox: bool = True
    # The reward of an episode a reward-hack monitor flagged (its flags are logged either way).
    flagged_reward: float = 0.0


@dataclasses.dataclass(frozen=True)
class HeldoutConfig:
    """The held-out evaluation before RL and at the end."""

    # `num_tasks` tasks of the `split` split of `tasks` (a task source spec; empty: the RL
    # tasks'), each sampled `samples` times. The split "held_out" holds tasks never trained on
    # (for builtin: other functions); "train" with the held-out seed gives fresh instances of
    # training tasks. Seeds: SFT draws from cfg.seed, RL prompts cfg.seed + 1, held-out
    # cfg.seed + 2.
    tasks: str = ""
    split: str = "held_out"
    num_tasks: int = 32
    samples: int = 2
    temperature: float = 1.0


def _moved_fields() -> dict[str, str]:
    """Each field of a section by its old flat name (`heldout_tasks` -> `heldout.tasks`)."""
    sections = (
        ("objective", RLObjectiveConfig, ""),
        ("rollout", RolloutConfig, ""),
        ("agent", AgentConfig, ""),
        ("heldout", HeldoutConfig, "heldout_"),
    )
    return {
        f"{prefix}{field.name}": f"{section}.{field.name}"
        for section, cls, prefix in sections
        for field in dataclasses.fields(cls)
    }


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """The RL objective, the rollouts that feed it, the agent they play and the held-out
    evaluation (`launch/rl.py`)."""

    objective: RLObjectiveConfig = RLObjectiveConfig()
    rollout: RolloutConfig = RolloutConfig()
    agent: AgentConfig = AgentConfig()
    heldout: HeldoutConfig = HeldoutConfig()
    # The RL prompts' task source spec (empty: data.tasks), their split "train".
    tasks: str = ""
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
    # A timeline of the actor loop ("": off): a Chrome / Perfetto trace (JSON trace events) at
    # this .json path, one track per role, and a summary table at <path minus .json>.summary.txt.
    trace: str = ""
    # The fields this config had before its sections, by old name -> path here: `from_dict` and
    # `--config.rl.<old>` still take them for one release, with a warning naming the new path.
    MOVED: typing.ClassVar[dict[str, str]] = _moved_fields()


def validate_rl_objective(cfg: RLObjectiveConfig, where: str = "rl.objective") -> None:
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


def parse_resources(spec: str, field: str) -> dict[str, float]:
    """Ray custom resources from "name=amount,..." ("" gives none)."""
    resources = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, amount = (text.strip() for text in item.partition("="))
        try:
            value = float(amount) if name else 0.0
        except ValueError:
            value = 0.0
        _check(
            value > 0, field, f"{spec!r}: expected name=amount,... with amounts > 0 (e.g. 'a=1')"
        )
        _check(
            name not in ("CPU", "GPU"),
            field,
            f"{name} is not a custom resource (the sampler's GPUs: rl.rollout.ray_sampler_gpus)",
        )
        resources[name] = value
    return resources


def validate_rl(cfg: RLConfig, where: str = "rl") -> None:
    """Each section's checks, then the fields that must fit together across sections."""
    validate_rl_objective(cfg.objective, f"{where}.objective")
    _check_rollout(cfg.rollout, f"{where}.rollout")
    _check_ray_fields(cfg.rollout, f"{where}.rollout")
    _check_agent(cfg.agent, f"{where}.agent")
    _check_heldout(cfg.heldout, f"{where}.heldout")
    _check_rl_top(cfg, where)


def _check_rollout(cfg: RolloutConfig, where: str) -> None:
    """Each field on its own: choices, signs, bucket order, sampling."""
    for name, allowed in (
        ("backend", RL_BACKENDS),
        ("env_workers", ENV_WORKER_KINDS),
        ("stale_policy", STALE_POLICIES),
        ("uniform_by", UNIFORM_BY),
    ):
        value = getattr(cfg, name)
        _check(value in allowed, f"{where}.{name}", f"{value!r} is not one of {allowed}")
    for name in (
        "num_env_workers",
        "num_samplers",
        "group_size",
        "groups_per_step",
        "epochs",
        "num_slots",
        "context_len",
        "max_new_tokens",
        "decode_chunk",
    ):
        _check(getattr(cfg, name) > 0, f"{where}.{name}", "must be positive")
    for name in ("num_prompts", "max_staleness", "schedule_ahead_groups"):
        _check(getattr(cfg, name) >= 0, f"{where}.{name}", "must be >= 0")
    _check(
        all(b > 0 for b in cfg.prefill_buckets)
        and list(cfg.prefill_buckets) == sorted(set(cfg.prefill_buckets)),
        f"{where}.prefill_buckets",
        f"{cfg.prefill_buckets}: must be positive and increasing",
    )
    _check(cfg.env_timeout_s >= 0, f"{where}.env_timeout_s", "must be >= 0 (0: derived)")
    _check(0 < cfg.stale_decay <= 1, f"{where}.stale_decay", "must lie in (0, 1]")
    _check(0 <= cfg.hard_prompt_fraction < 1, f"{where}.hard_prompt_fraction", "must lie in [0, 1)")
    _check(cfg.temperature > 0, f"{where}.temperature", "RL samples: must be > 0")
    _check(0 < cfg.top_p <= 1, f"{where}.top_p", "must lie in (0, 1]")
    _check(
        cfg.group_size <= cfg.num_slots,
        f"{where}.group_size",
        f"a group ({cfg.group_size}) must fit in the sampler's num_slots ({cfg.num_slots})",
    )


def _check_ray_fields(cfg: RolloutConfig, where: str) -> None:
    """Ray placement: well-formed, and set only with the Ray backend."""
    _check(cfg.ray_sampler_gpus >= 0, f"{where}.ray_sampler_gpus", "must be >= 0")
    _check(cfg.ray_placement_timeout_s > 0, f"{where}.ray_placement_timeout_s", "must be > 0")
    for name in ("ray_sampler_resources", "ray_env_resources"):
        parse_resources(getattr(cfg, name), f"{where}.{name}")
    defaults = RolloutConfig()
    _check(
        cfg.backend != "ray" or cfg.env_workers == defaults.env_workers,
        f"{where}.env_workers",
        f"chooses the threads backend's workers; with {where}.backend='ray' environment workers "
        f"are Ray actors (place them with {where}.ray_env_resources)",
    )
    if cfg.backend != "ray":
        for name in (
            "num_samplers",
            "ray_sampler_gpus",
            "ray_sampler_resources",
            "ray_env_resources",
            "ray_placement_timeout_s",
        ):
            _check(
                getattr(cfg, name) == getattr(defaults, name),
                f"{where}.{name}",
                f"places Ray actors: set it with {where}.backend='ray' (not {cfg.backend!r})",
            )


def _check_agent(cfg: AgentConfig, where: str) -> None:
    """Turn and summary budgets (the plug-in names are resolved by `agent.check_agent_config`)."""
    for name in ("max_turns", "summary_max_tokens"):
        _check(getattr(cfg, name) > 0, f"{where}.{name}", "must be positive")
    for name in ("summary_budget", "max_summaries", "open_tab_lines"):
        _check(getattr(cfg, name) >= 0, f"{where}.{name}", "must be >= 0")


def _check_heldout(cfg: HeldoutConfig, where: str) -> None:
    for name in ("num_tasks", "samples"):
        _check(getattr(cfg, name) > 0, f"{where}.{name}", "must be positive")
    _check(cfg.temperature >= 0, f"{where}.temperature", "must be >= 0")


def _check_rl_top(cfg: RLConfig, where: str) -> None:
    """Weight sync, warm start and tracing, and the summaries that must fit the sampler's
    context."""
    _check(
        cfg.weight_delta in ("xor", "add"),
        f"{where}.weight_delta",
        f"{cfg.weight_delta!r} is not one of ('xor', 'add')",
    )
    for name in ("snapshot_every", "warm_start_steps"):
        _check(getattr(cfg, name) > 0, f"{where}.{name}", "must be positive")
    if cfg.trace:
        _check(
            cfg.trace.endswith(".json") and "://" not in cfg.trace,
            f"{where}.trace",
            f"{cfg.trace!r}: name a local .json file (the summary is written next to it)",
        )
        _check(
            cfg.rollout.backend == "threads",
            f"{where}.trace",
            "traces the threads backend (with ray the sampler and environments run elsewhere)",
        )
    agent = cfg.agent
    _check(
        agent.summary_budget == 0
        or agent.summary_budget + agent.summary_max_tokens < cfg.rollout.context_len,
        f"{where}.agent.summary_budget",
        f"{where}.agent.summary_budget + summary_max_tokens must be below "
        f"{where}.rollout.context_len",
    )
