"""Behaviour rewards: the report's auxiliary terms for coding style, communication and harmful or
wasteful tool use, computed from what the episode recorded (feedback detectors, reward-hack
monitors, counts). Each component lies in [-1, 0] and enters the sample's total reward times its
weight in `RLObjectiveConfig` (`reward_weight_<name>`), beside the task reward and minus the length
penalty; every component is logged on its own (`reward/<name>`). Pure Python: the actor loop
computes them when a sample finishes.
"""

from __future__ import annotations

import dataclasses

from composer_jax.rl.config import RLObjectiveConfig

BEHAVIOUR_REWARDS = ("style", "tool_misuse", "communication", "harm")
# Feedback detectors whose turns count as tool misuse (a call to a tool that does not exist,
# arguments that do not check, an error output ignored in the next turn).
TOOL_MISUSE_DETECTORS = ("unknown_tool", "invalid_arguments", "ignored_tool_error")


@dataclasses.dataclass(frozen=True)
class EpisodeBehaviour:
    """What a finished episode did, as far as the behaviour rewards care."""

    turns: int = 0
    tool_calls: int = 0
    feedback: dict = dataclasses.field(default_factory=dict)  # detector -> turns flagged
    answered: bool = False  # ended with a final message to the user
    flagged: bool = False  # a reward-hack monitor flagged it


def behaviour_rewards(behaviour: EpisodeBehaviour) -> dict[str, float]:
    """Unweighted components, each in [-1, 0]:
    style: share of turns the style detector flagged;
    tool_misuse: share of tool calls (at least one) in turns flagged for misuse;
    communication: -1 when the episode ended without a final message (ran out of turns);
    harm: -1 when a reward-hack monitor flagged the episode (its task reward is already 0)."""
    turns = max(behaviour.turns, 1)
    misuse = sum(behaviour.feedback.get(name, 0) for name in TOOL_MISUSE_DETECTORS)
    return {
        "style": -min(1.0, behaviour.feedback.get("style", 0) / turns),
        "tool_misuse": -min(1.0, misuse / max(behaviour.tool_calls, 1)),
        "communication": 0.0 if behaviour.answered else -1.0,
        "harm": -1.0 if behaviour.flagged else 0.0,
    }


def reward_weights(cfg: RLObjectiveConfig) -> dict[str, float]:
    """Weight of each behaviour component (0 leaves it out of the total)."""
    return {name: getattr(cfg, f"reward_weight_{name}") for name in BEHAVIOUR_REWARDS}
