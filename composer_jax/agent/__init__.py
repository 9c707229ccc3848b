"""The coding agent: the workflow that plays an episode, its tools' feedback, its behaviour
rewards, the scripted agent that warm-starts it, and the synchronous driver.

`workflow` is the per-episode state machine (begin, turn, environment result, summary, end) that
both drivers run: `composer_jax.actor.episodes` in the asynchronous actor loop, `play` here for
evaluation. `setup` builds one from a run's config; `rewards` and `feedback` are registries;
`oracle` and `sft` make the supervised warm start.
"""

from composer_jax.agent.play import (
    collect_batch,
    episode_stats,
    group_jobs,
    play,
    rollout_sampling,
    sampler_engine,
)
from composer_jax.agent.rewards import (
    BEHAVIOUR_REWARDS,
    BehaviourRewards,
    EpisodeBehaviour,
    behaviour_reward,
    reward_weights,
)
from composer_jax.agent.setup import build, check_agent_config, env_config, make_workflow
from composer_jax.agent.sft import sft_examples
from composer_jax.agent.workflow import (
    FINISH,
    WORKFLOWS,
    AgentEpisode,
    AgentWorkflow,
    Continue,
    EpisodeOutcome,
    Finish,
    Restart,
    Step,
    Submit,
    Workflow,
    WorkflowContext,
)

__all__ = [
    "BEHAVIOUR_REWARDS",
    "FINISH",
    "WORKFLOWS",
    "AgentEpisode",
    "AgentWorkflow",
    "BehaviourRewards",
    "Continue",
    "EpisodeBehaviour",
    "EpisodeOutcome",
    "Finish",
    "Restart",
    "Step",
    "Submit",
    "Workflow",
    "WorkflowContext",
    "behaviour_reward",
    "build",
    "check_agent_config",
    "collect_batch",
    "env_config",
    "episode_stats",
    "group_jobs",
    "make_workflow",
    "play",
    "reward_weights",
    "rollout_sampling",
    "sampler_engine",
    "sft_examples",
]
