"""A researcher's own agent pieces, outside the package, chosen by config: a workflow that asks
for a plan first (`--config.rl.agent.workflow=tests.agent.plugins:plan_first`), a behaviour reward
(`--config.rl.agent.behaviour_rewards=tests.agent.plugins:thanks=0.1`) and a feedback detector
(`--config.rl.agent.feedback_detectors=style,tests.agent.plugins:LongTurn`)."""

from composer_jax.agent import AgentWorkflow

PLAN_NOTE = "Plan first: keep a todo list.\n"


class PlanFirst(AgentWorkflow):
    """The built-in workflow with a note before the task."""

    def begin(self, task, key, observation):
        return super().begin(task, key, PLAN_NOTE + observation)


def plan_first(context):
    return PlanFirst(context)


def thanks(behaviour, context) -> float:
    """-1 unless the final message thanks the user."""
    return 0.0 if "thank" in (behaviour.final_message or "").lower() else -1.0


def always_pleased(behaviour) -> float:
    """A stand-in for a model judge of the final message: the same interface as the rubric."""
    return 1.0


class LongTurn:
    """A turn of more than 1,000 characters."""

    name = "long_turn"

    def check(self, turn, previous) -> str | None:
        if len(turn.text) <= 1000:
            return None
        return f"Keep a turn short: this one has {len(turn.text)} characters."
