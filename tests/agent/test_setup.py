"""The agent package's entry points take the agent section (`rl.agent`), not the whole RL config:
the environment, the start-up check and the built workflow read everything they need from it."""

from composer_jax import agent
from composer_jax.config import AgentConfig, ModelConfig, RolloutConfig
from composer_jax.data import ByteTokenizer


def test_env_config_takes_the_agent_section():
    section = AgentConfig(
        tools="read_file,list_dir",
        eval_tools="agent_no_shell",
        max_turns=3,
        open_tab_lines=7,
        require_sandbox=False,
        flagged_reward=-0.5,
    )
    env = agent.env_config(section)
    assert env.tools == ("read_file", "list_dir")
    assert (env.max_turns, env.open_tab_lines) == (3, 7)
    assert (env.require_isolation, env.flagged_reward) == (False, -0.5)
    assert "run_shell" not in agent.env_config(section, evaluation=True).tools
    assert "search_code" in agent.env_config(section, evaluation=True).tools
    assert agent.env_config(section, max_turns=9).max_turns == 9


def test_check_and_build_take_the_agent_section():
    section = AgentConfig(max_turns=4, summary_budget=200, feedback_detectors=("style",))
    agent.check_agent_config(section)
    rollout = RolloutConfig(max_new_tokens=32, temperature=0.7)
    workflow, env = agent.build(
        section,
        ByteTokenizer(),
        ModelConfig(),
        max_len=rollout.context_len,
        sampling=agent.rollout_sampling(rollout),
        distill=True,
    )
    assert env == agent.env_config(section)
    context = workflow.context
    assert context.agent is section and context.env_config == env
    assert (context.max_len, context.distill) == (rollout.context_len, True)
    assert (context.sampling.max_new_tokens, context.sampling.temperature) == (32, 0.7)
