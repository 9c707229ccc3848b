"""An agent from a run's config: its environment (tool profile, turn limit), its workflow, and the
start-up check of every plug-in name it uses, with one-line errors that name the config field."""

from __future__ import annotations

from composer_jax.agent import feedback, rewards
from composer_jax.agent.workflow import Workflow, WorkflowContext, workflow_factory
from composer_jax.config import AgentConfig, ConfigError, ModelConfig
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.envs import EnvConfig
from composer_jax.envs.tools import tool_profile
from composer_jax.infer import SamplingParams


def _checked(field: str, check, *args):
    try:
        return check(*args)
    except ValueError as error:
        raise ConfigError(f"{field}: {error}") from None


def tools_field(agent: AgentConfig, evaluation: bool) -> str:
    """The config field that names the tool profile: rl.agent.eval_tools when it is set for an
    evaluation, else rl.agent.tools."""
    return "rl.agent.eval_tools" if evaluation and agent.eval_tools else "rl.agent.tools"


def env_config(agent: AgentConfig, evaluation: bool = False, **overrides) -> EnvConfig:
    """The environment an episode runs in: the profile's tools (`tools` for training,
    `eval_tools` (else the same) for held-out checks), the turn limit, the sandbox rule, the
    open tab."""
    field = tools_field(agent, evaluation)
    tools = _checked(field, tool_profile, getattr(agent, field.rpartition(".")[2]))
    settings = dict(
        tools=tools,
        max_turns=agent.max_turns,
        require_isolation=agent.require_sandbox,
        flagged_reward=agent.flagged_reward,
        open_tab_lines=agent.open_tab_lines,
    )
    return EnvConfig(**{**settings, **overrides})


def check_agent_config(agent: AgentConfig) -> None:
    """Resolves every name the agent's config gives (workflow, behaviour rewards, judge, feedback
    detectors, tool profiles) before anything runs; a ConfigError names the first bad field."""
    _checked("rl.agent.workflow", workflow_factory, agent.workflow)
    _checked("rl.agent.behaviour_rewards", rewards.reward_weights, agent.behaviour_rewards)
    _checked("rl.agent.communication_judge", rewards.resolve_judge, agent.communication_judge)
    _checked("rl.agent.feedback_detectors", feedback.make_detectors, agent.feedback_detectors)
    env_config(agent)
    env_config(agent, evaluation=True)


def make_workflow(
    agent: AgentConfig,
    tokenizer: Tokenizer,
    model: ModelConfig,
    environment: EnvConfig,
    *,
    max_len: int,
    sampling: SamplingParams,
    distill: bool,
) -> Workflow:
    """The run's workflow for episodes in `environment`: generations of at most `max_len` tokens
    (the sampler's context, `rl.rollout.context_len`) sampled with `sampling`
    (`play.rollout_sampling` for the RL sampler's); `distill`: the objective trains on the hinted
    teacher (`rl.objective.distill_coef > 0`), so feedback builds its context."""
    context = WorkflowContext(
        agent=agent,
        tokenizer=tokenizer,
        env_config=environment,
        max_len=max_len,
        sampling=sampling,
        num_moe_layers=model.num_moe_layers,
        experts_per_token=model.num_experts_per_tok,
        distill=distill,
    )
    factory = _checked("rl.agent.workflow", workflow_factory, agent.workflow)
    return _checked("rl.agent.workflow", factory, context)


def build(
    agent: AgentConfig,
    tokenizer: Tokenizer,
    model: ModelConfig,
    *,
    max_len: int,
    sampling: SamplingParams,
    distill: bool,
    evaluation: bool = False,
) -> tuple[Workflow, EnvConfig]:
    """The run's workflow and the environment it plays in (`env_config`), built together."""
    environment = env_config(agent, evaluation)
    workflow = make_workflow(
        agent, tokenizer, model, environment, max_len=max_len, sampling=sampling, distill=distill
    )
    return workflow, environment
