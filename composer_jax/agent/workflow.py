"""The agent workflow: one episode's decisions, as a plain state machine that drivers run.

A workflow takes an episode from its task's first observation to its end. It never touches a
thread, a slot or a queue: a driver calls it with what happened and does what it answers.

    begin(task, key, observation) -> (episode, Submit)    the first request
    on_completion(episode, completion) -> Step | Restart  a finished turn: run it in the
                                                          environment (or a summary: restart)
    on_result(episode, result) -> Continue | Finish       the environment's answer: the next
                                                          context (tool output, a summary
                                                          request), or the end
    resume(episode) -> Submit                             a restored episode's next turn
    abandon(episode, task, key) -> episode                its environment failed for good
    outcome(episode) -> EpisodeOutcome                    generations, reward, behaviour

Two drivers run it: `composer_jax.actor.episodes.EpisodeDriver` (the asynchronous actor loop:
slots, environment workers, re-queues, in-flight records) and `composer_jax.agent.play.play`
(one engine, synchronous: the held-out check, `launch.evaluate`, tests), so training and
evaluation play the same episode. `rl.agent.workflow` chooses it: "builtin" (`AgentWorkflow`) or a
factory by import path (`my_pkg.workflows:make`, called with a `WorkflowContext`).

The episode state (`AgentEpisode`) is plain data: the in-flight records pickle it, so an episode
caught between two turns resumes after a restart. Randomness is per episode and generation
(`key`, the summaries so far), never per slot, so both drivers sample the same tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections.abc import Callable
from typing import Protocol

import numpy as np

from composer_jax import plugins
from composer_jax.agent import feedback
from composer_jax.agent.generation import Generation
from composer_jax.agent.kinds import segment_kind, token_kinds, turn_sampling
from composer_jax.agent.rewards import BehaviourRewards, EpisodeBehaviour
from composer_jax.config import AgentConfig
from composer_jax.data.chat import chat_format_for
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.envs import EnvConfig, StepResult, Task
from composer_jax.envs.grading import protocol
from composer_jax.envs.tools import ToolCallRecord
from composer_jax.infer import Completion, SamplingParams
from composer_jax.model.moe import UNROUTED
from composer_jax.rl.batch import SegmentKind, Sequence

log = logging.getLogger(__name__)

SUMMARY_OPEN, SUMMARY_CLOSE = "<summary>", "</summary>"
SUMMARY_NOTE = (
    "\n[context budget reached: summarise the task and your progress for a fresh start]\n"
)
# Where the first lines of a long tool output gave way to the summary's budget.
_CUT_NOTE = "[{} lines cut to leave room for the summary]"


@dataclasses.dataclass(frozen=True)
class Submit:
    """A new request with this context."""

    tokens: list[int]
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class Continue:
    """The same request, its cache kept: append these tokens and generate."""

    appended: list[int]
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class Restart:
    """The same request from its first `keep` cached tokens plus `appended` (a summary)."""

    keep: int
    appended: list[int]
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class Step:
    """Run this turn in the environment; `last`: the environment ends the episode with it."""

    text: str
    last: bool


@dataclasses.dataclass(frozen=True)
class Finish:
    """The episode is over: its `outcome` is ready."""


FINISH = Finish()
Action = Submit | Continue | Restart | Step | Finish


@dataclasses.dataclass(frozen=True)
class WorkflowContext:
    """What a workflow is built from."""

    agent: AgentConfig  # turns, summaries, feedback, behaviour rewards
    tokenizer: Tokenizer
    env_config: EnvConfig  # the tools this episode offers (the profile) and the turn limit
    max_len: int  # the sampler's context, in tokens
    sampling: SamplingParams  # temperature, top_p, max_new_tokens per turn; seed: the run's
    num_moe_layers: int
    experts_per_token: int
    distill: bool  # the objective trains on the hinted teacher (rl.objective.distill_coef > 0)


@dataclasses.dataclass
class EpisodeOutcome:
    """A finished episode, as training and evaluation read it."""

    sequences: list[Sequence]  # one per generation (several when it summarised)
    reward: float  # the task reward (0 when truncated or flagged)
    truncated: bool = False
    # Ended by no act of the policy (its environment failed for good, or its prompt left no room
    # to answer): scored 0, and left out of its group's advantages and baseline (no policy
    # gradient; a KL placed in the loss still applies to its tokens).
    abandoned: bool = False
    summaries: int = 0
    num_tool_calls: int = 0
    num_turns: int = 0
    feedback: dict[str, int] = dataclasses.field(default_factory=dict)  # detector -> turns
    flags: tuple = ()  # reward-hack monitor flags
    behaviour: dict[str, float] = dataclasses.field(default_factory=dict)  # unweighted values
    grade: dict | None = None  # the grader's result (outcomes, scores)
    # What it did: every tool call, the files it changed, its final message (`stages` reads it).
    trace: EpisodeBehaviour | None = None

    @property
    def flagged(self) -> bool:
        return bool(self.flags)

    @property
    def policy_tokens(self) -> int:
        return int(sum(s.policy_mask.sum() for s in self.sequences))

    @property
    def thinking_tokens(self) -> int:
        return int(
            sum(((s.kinds == SegmentKind.THINKING) & s.policy_mask).sum() for s in self.sequences)
        )


@dataclasses.dataclass(kw_only=True, eq=False)
class AgentEpisode(Generation):
    """One episode's state: the current generation's buffers, the closed ones, what happened."""

    key: str  # seeds derive from (run seed, key, summaries so far)
    task_id: str
    prompt_tokens: list[int] = dataclasses.field(default_factory=list)
    sequences: list[Sequence] = dataclasses.field(default_factory=list)
    # Turns (start, end, hint tokens) a feedback detector flagged: their teacher context has the
    # hint (text-feedback distillation).
    hinted: list[tuple[int, int, np.ndarray]] = dataclasses.field(default_factory=list)
    num_turns: int = 0
    # The last turn of the current generation: what the detectors compare a turn with (none
    # after a summary restart, whose context no longer holds it).
    last_turn: feedback.TurnRecord | None = None
    feedback_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    calls: list[ToolCallRecord] = dataclasses.field(default_factory=list)
    turn_span: tuple[int, int] = (0, 0)
    turn_text: str = ""
    finish_reason: str | None = None  # of the last turn
    summarising: bool = False
    summaries: int = 0
    truncated: bool = False
    abandoned: bool = False
    reward: float = 0.0
    counts: dict = dataclasses.field(default_factory=dict)
    flags: tuple = ()
    grade: dict | None = None
    behaviour: dict[str, float] = dataclasses.field(default_factory=dict)
    trace: EpisodeBehaviour | None = None
    resume_from: int | None = None  # restored: the prefix's routes are already known
    open_tab: str = ""  # the open tab as the last step's edits left it ("" if unedited)
    done: bool = False


class Workflow(Protocol):
    def begin(self, task: Task, key: str, observation: str) -> tuple[object, Action]: ...

    def on_completion(self, episode, completion: Completion) -> Action: ...

    def on_result(self, episode, result: StepResult) -> Action: ...

    def resume(self, episode) -> Action: ...

    def resumable(self, episode) -> bool: ...

    def abandon(self, episode, task: Task, key: str) -> object: ...

    def outcome(self, episode) -> EpisodeOutcome: ...


class AgentWorkflow:
    """The built-in agent: turns of tool calls until a final message or the turn limit, a
    summary whenever a generation's context reaches `rl.agent.summary_budget` (the next generation
    restarts from the task plus the summary; the chain shares the final reward), feedback
    detectors on every turn (their hints build the teacher context when the objective distils,
    `context.distill`), and the run's behaviour rewards when the episode ends."""

    def __init__(self, context: WorkflowContext):
        self.context = context
        agent = context.agent
        self.agent, self.tokenizer, self.max_len = agent, context.tokenizer, context.max_len
        self.chat = chat_format_for(context.tokenizer)
        self.detectors = feedback.make_detectors(agent.feedback_detectors)
        self.rewards = BehaviourRewards(agent.behaviour_rewards, agent.communication_judge)
        base = dataclasses.replace(context.sampling, keep_cache=True)
        self._turn_params = turn_sampling(base, self.chat)
        self._summary_params = turn_sampling(
            dataclasses.replace(base, max_new_tokens=agent.summary_max_tokens),
            self.chat,
            markers=(SUMMARY_CLOSE,),
        )

    # ----------------------------------------------------------------- requests
    def params_for(self, episode: AgentEpisode, summary: bool = False, room: int | None = None):
        """The sampling settings of the episode's next request: distinct, reproducible
        randomness per episode and generation, at most `room` new tokens."""
        base = self._summary_params if summary else self._turn_params
        key = f"{self.context.sampling.seed}/{episode.key}/{episode.summaries}"
        params = dataclasses.replace(base, seed=zlib.crc32(key.encode()) & 0x7FFFFFFF)
        if room is not None:
            params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room))
        return params

    def begin(self, task: Task, key: str, observation: str) -> tuple[AgentEpisode, Action]:
        episode = AgentEpisode(key=key, task_id=task.task_id)
        prompt = self.chat.prompt(observation)
        episode.prompt_tokens = prompt
        episode.add_context(prompt, SegmentKind.PROMPT)
        if len(prompt) + 1 >= self.max_len:
            log.warning(
                "task %s: its prompt (%d tokens) leaves no room to answer in a context of %d; it "
                "scores 0 (raise rl.rollout.context_len)",
                task.task_id,
                len(prompt),
                self.max_len,
            )
            self._give_up(episode)
            return episode, FINISH
        return episode, Submit(prompt, self.params_for(episode))

    def resume(self, episode: AgentEpisode) -> Action:
        """The whole buffer is the context; its recorded routes are kept."""
        episode.resume_from = len(episode.routes)
        room = self.max_len - len(episode.tokens) - 1
        return Submit(list(episode.tokens), self.params_for(episode, room=room))

    def resumable(self, episode: AgentEpisode) -> bool:
        """Between two turns, waiting on the policy (not summarising): what a snapshot of its
        environment can resume."""
        return not episode.done and not episode.summarising and episode.counts.get("turns", 0) > 0

    # ----------------------------------------------------------------- turns
    def on_completion(self, episode: AgentEpisode, completion: Completion) -> Action:
        if episode.summarising:
            return self._finish_summary(episode, completion)
        if episode.resume_from is not None:  # the recorded prefix keeps its recorded routes
            completion.prompt_experts = completion.prompt_experts[episode.resume_from :]
            episode.resume_from = None
        episode.turn_span = (len(episode.tokens), len(episode.tokens) + len(completion.tokens))
        episode.add_turn(completion, token_kinds(completion.tokens, self.tokenizer))
        episode.turn_text = self.tokenizer.decode(completion.tokens)
        episode.finish_reason = completion.finish_reason
        # Exactly when the environment ends the episode (a driver frees the slot on `last`).
        final = protocol.parse_turn(episode.turn_text).final is not None
        last = final or episode.counts.get("turns", 0) + 1 >= self.context.env_config.max_turns
        return Step(episode.turn_text, last=last)

    def on_result(self, episode: AgentEpisode, result: StepResult) -> Action:
        self._check_feedback(episode, result)
        episode.calls += list(result.info.get("calls", ()))
        episode.counts, episode.reward = result.counts, result.reward
        episode.open_tab = result.info.get("open_tab", "")
        if result.done:
            episode.flags, episode.grade = tuple(result.flags), result.info.get("grade")
            return self._finish(episode, result.info)
        generated = episode.tokens[-1:]  # did the turn end with the template's end of turn?
        segments = self.chat.after_turn(result.observation, generated)
        appended = [i for segment in segments for i in segment.ids]
        full = episode.finish_reason == "max_len"
        room = self.max_len - len(episode.tokens) - len(appended) - 1
        agent = self.agent
        if agent.summary_budget and episode.summaries < agent.max_summaries and not full:
            if len(episode.tokens) + len(appended) >= agent.summary_budget:
                return self._request_summary(episode, result.observation, generated)
        if full or room < 16:  # no room for another turn: reward 0
            return self._truncate(episode)
        for segment in segments:
            episode.add_context(segment.ids, segment_kind(segment))
        return Continue(appended, self.params_for(episode, room=room))

    def _check_feedback(self, episode: AgentEpisode, result: StepResult) -> None:
        if not self.detectors:
            return
        turn = feedback.TurnRecord(
            index=episode.num_turns,
            text=episode.turn_text,
            calls=tuple(result.info.get("calls", ())),
            observation=result.observation,
            available_tools=tuple(self.context.env_config.tools),
        )
        previous, episode.last_turn = episode.last_turn, turn
        episode.num_turns += 1
        hints = feedback.check_turn(self.detectors, turn, previous)
        if not hints:
            return
        if self.context.distill:  # the teacher context is only built when it is trained on
            # The hint quotes tool errors: text the code under test wrote.
            hint = self.tokenizer.encode(feedback.render_hint(hints), special=False)
            start, end = episode.turn_span
            episode.hinted.append((start, end, np.asarray(hint, np.int32)))
        for name, _ in hints:
            episode.feedback_counts[name] = episode.feedback_counts.get(name, 0) + 1

    # ----------------------------------------------------------------- summaries
    def _request_summary(self, episode: AgentEpisode, observation: str, generated) -> Action:
        """Appends the tool output and the summary request; the next turn is the summary."""
        segments, room = self._summary_request(episode, observation, generated)
        if room < 8:  # the budget leaves no room for a summary: the sample is truncated
            return self._truncate(episode)
        for segment in segments:
            episode.add_context(segment.ids, segment_kind(segment))
        episode.summarising = True
        appended = [i for segment in segments for i in segment.ids]
        return Continue(appended, self.params_for(episode, summary=True, room=room))

    def _summary_request(self, episode: AgentEpisode, observation: str, generated):
        """(the segments that append the tool output and ask for the summary, the room they
        leave it). Where a long output would leave the summary less than its budget, the fewest
        first lines of the last output are cut that give it the budget (as many as may be, where
        none does, if that leaves more room than no cut): its end stays (`cut_output_head`)."""

        def request(cut: int):
            text = protocol.cut_output_head(observation, cut, _CUT_NOTE)
            segments = self.chat.after_turn(
                text, generated, note=SUMMARY_NOTE, assistant_prefix=SUMMARY_OPEN
            )
            room = self.max_len - len(episode.tokens) - sum(len(s.ids) for s in segments) - 1
            return segments, room

        uncut = request(0)
        budget, most = self.agent.summary_max_tokens, protocol.cuttable_output_lines(observation)
        if uncut[1] >= budget or not most:
            return uncut
        # The fewest lines whose cut gives the budget (past the note's own length, each line cut
        # adds room).
        low, high = 1, most
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if request(middle)[1] >= budget else (middle + 1, high)
        cut = request(low)
        return cut if cut[1] > uncut[1] else uncut

    def _finish_summary(self, episode: AgentEpisode, completion: Completion) -> Action:
        """Closes the generation with its summary; the next one starts from task + summary (and
        the open tab, where the episode edited it since the task showed it), reusing the cached
        task prompt."""
        episode.add_turn(completion, np.full(len(completion.tokens), SegmentKind.SUMMARY, np.int32))
        summary = self.tokenizer.decode(completion.tokens)
        if not summary.endswith(SUMMARY_CLOSE):
            summary += SUMMARY_CLOSE
        self._close_generation(episode)
        episode.summaries += 1
        keep = len(episode.prompt_tokens)
        prefix_routes = episode.routes[:keep]
        appended = self.tokenizer.encode(f"{SUMMARY_OPEN}{summary}\n{episode.open_tab}")
        episode.clear()
        episode.hinted, episode.last_turn = [], None
        episode.add_context(episode.prompt_tokens, SegmentKind.PROMPT)
        episode.add_context(appended, SegmentKind.PROMPT)  # carried over: counted once, as context
        # The kept prefix is cached with its routes; the restart prefills (and routes) only the
        # appended tokens, from position `keep` on.
        episode.routes = prefix_routes
        episode.summarising = False
        room = self.max_len - keep - len(appended) - 1
        return Restart(keep, appended, self.params_for(episode, room=room))

    # ----------------------------------------------------------------- the end
    def _close_generation(self, episode: AgentEpisode) -> None:
        try:
            sequence = episode.to_sequence(
                0, self.context.num_moe_layers, self.context.experts_per_token, episode.hinted
            )
        except RuntimeError as e:
            raise RuntimeError(f"{episode.key}: {e}") from None
        episode.sequences.append(sequence)

    def _finish(self, episode: AgentEpisode, info: dict) -> Action:
        self._close_generation(episode)
        final = protocol.parse_turn(episode.turn_text).final if "grade" in info else None
        episode.trace = EpisodeBehaviour(
            turns=int(episode.counts.get("turns", 0)),
            tool_calls=tuple(episode.calls),
            feedback=dict(episode.feedback_counts),
            final_message=final,
            todo=tuple(info.get("todo", ())),
            changes=dict(info.get("changes", {})),
            flagged=bool(episode.flags),
            summaries=episode.summaries,
        )
        episode.behaviour = self.rewards.values(episode.trace)
        episode.done = True
        return FINISH

    def _truncate(self, episode: AgentEpisode) -> Action:
        episode.truncated, episode.reward = True, 0.0
        return self._finish(episode, {})

    def _give_up(self, episode: AgentEpisode) -> None:
        """Scores the episode 0 as truncated and abandoned (no sample of the group is measured
        against it), keeping what it generated; a generation that holds no turn keeps at most
        its first tokens."""
        episode.truncated, episode.abandoned, episode.reward = True, True, 0.0
        episode.summarising = False
        if not any(episode.policy):
            keep = 2 if len(episode.tokens) >= 2 else len(episode.tokens)
            for name in ("tokens", "kinds", "policy", "logprobs", "versions"):
                setattr(episode, name, getattr(episode, name)[:keep])
            episode.hinted = []
        if not episode.tokens:  # never started: an empty generation cannot be trained on
            episode.add_context(self.tokenizer.encode("\n"), SegmentKind.PROMPT)
        shape = (self.context.num_moe_layers, self.context.experts_per_token)
        episode.routes = episode.routes[: max(len(episode.tokens) - 1, 0)]
        while len(episode.routes) < len(episode.tokens) - 1:
            episode.routes.append(np.full(shape, UNROUTED, np.int32))
        self._finish(episode, {})

    def abandon(self, episode: AgentEpisode | None, task: Task, key: str) -> AgentEpisode:
        """The environment failed for good (before the episode began when `episode` is None):
        the finished episode, reward 0, truncated."""
        if episode is None:
            episode = AgentEpisode(key=key, task_id=task.task_id)
        self._give_up(episode)
        return episode

    def outcome(self, episode: AgentEpisode) -> EpisodeOutcome:
        if not episode.done:
            raise RuntimeError(f"{episode.key}: the episode has not finished")
        return EpisodeOutcome(
            sequences=list(episode.sequences),
            reward=float(episode.reward),
            truncated=episode.truncated,
            abandoned=episode.abandoned,
            summaries=episode.summaries,
            num_tool_calls=int(episode.counts.get("tool_calls", 0)),
            num_turns=int(episode.counts.get("turns", 0)),
            feedback=dict(episode.feedback_counts),
            flags=tuple(episode.flags),
            behaviour=dict(episode.behaviour),
            grade=episode.grade,
            trace=episode.trace,
        )


WorkflowFactory = Callable[[WorkflowContext], Workflow]
WORKFLOWS: dict[str, WorkflowFactory] = {"builtin": AgentWorkflow}


def workflow_factory(spec: str) -> WorkflowFactory:
    """The factory `rl.agent.workflow` names: a registered one, or `module:callable`."""
    factory = plugins.resolve(WORKFLOWS, spec, "workflow")
    if not callable(factory):
        raise ValueError(f"workflow {spec!r} is not callable")
    return factory
