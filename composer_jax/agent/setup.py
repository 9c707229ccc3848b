"""An agent from a run's config: its environment (tool profile, turn limit), its workflow, and the
start-up check of every plug-in name it uses, with one-line errors that name the config field."""

from __future__ import annotations

from composer_jax.agent import feedback, rewards
from composer_jax.agent.workflow import Workflow, WorkflowContext, workflow_factory
from composer_jax.config import ConfigError, ModelConfig, RLConfig
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.envs import EnvConfig
from composer_jax.envs.tools import tool_profile
from composer_jax.infer import SamplingParams


def _checked(field: str, check, *args):
    try:
        return check(*args)
    except ValueError as error:
        raise ConfigError(f"{field}: {error}") from None


def tools_field(rl: RLConfig, evaluation: bool) -> str:
    """The config field that names the tool profile: rl.eval_tools when it is set for an
    evaluation, else rl.tools."""
    return "rl.eval_tools" if evaluation and rl.eval_tools else "rl.tools"


def env_config(rl: RLConfig, evaluation: bool = False, **overrides) -> EnvConfig:
    """The environment an episode runs in: the profile's tools (`rl.tools` for training,
    `rl.eval_tools` (else the same) for held-out checks), `rl.max_turns`, the sandbox rule, the
    open tab."""
    field = tools_field(rl, evaluation)
    tools = _checked(field, tool_profile, getattr(rl, field.split(".")[1]))
    settings = dict(
        tools=tools,
        max_turns=rl.max_turns,
        require_isolation=rl.require_sandbox,
        flagged_reward=rl.flagged_reward,
        open_tab_lines=rl.open_tab_lines,
    )
    return EnvConfig(**{**settings, **overrides})


def check_agent_config(rl: RLConfig) -> None:
    """Resolves every name the agent's config gives (workflow, behaviour rewards, judge, feedback
    detectors, tool profiles) before anything runs; a ConfigError names the first bad field."""
    _checked("rl.workflow", workflow_factory, rl.workflow)
    _checked("rl.behaviour_rewards", rewards.reward_weights, rl.behaviour_rewards)
    _checked("rl.communication_judge", rewards.resolve_judge, rl.communication_judge)
    _checked("rl.feedback_detectors", feedback.make_detectors, rl.feedback_detectors)
    env_config(rl)
    env_config(rl, evaluation=True)


def make_workflow(
    rl: RLConfig,
    tokenizer: Tokenizer,
    model: ModelConfig,
    environment: EnvConfig,
    *,
    max_len: int | None = None,
    sampling: SamplingParams | None = None,
    seed: int = 0,
) -> Workflow:
    """The run's workflow for episodes in `environment`: `max_len` defaults to rl.context_len,
    `sampling` to the RL sampling settings (rl.temperature, rl.top_p, rl.max_new_tokens) with
    `seed`; every episode's randomness derives from the sampling seed and its key."""
    if sampling is None:
        sampling = SamplingParams(
            temperature=rl.temperature, top_p=rl.top_p, max_new_tokens=rl.max_new_tokens, seed=seed
        )
    context = WorkflowContext(
        rl=rl,
        tokenizer=tokenizer,
        env_config=environment,
        max_len=max_len or rl.context_len,
        sampling=sampling,
        num_moe_layers=model.num_moe_layers,
        experts_per_token=model.num_experts_per_tok,
    )
    factory = _checked("rl.workflow", workflow_factory, rl.workflow)
    return _checked("rl.workflow", factory, context)


def build(
    rl: RLConfig,
    tokenizer: Tokenizer,
    model: ModelConfig,
    *,
    evaluation: bool = False,
    max_len: int | None = None,
    sampling: SamplingParams | None = None,
    seed: int = 0,
) -> tuple[Workflow, EnvConfig]:
    """The run's workflow and the environment it plays in (`env_config`), built together."""
    environment = env_config(rl, evaluation)
    workflow = make_workflow(
        rl, tokenizer, model, environment, max_len=max_len, sampling=sampling, seed=seed
    )
    return workflow, environment
