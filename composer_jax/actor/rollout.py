"""Synchronous multi-turn rollouts: the inference engine plays episodes, the result is packed.

Each episode is one request that keeps its cache slot between turns: the policy writes a turn
(generation stops once its text holds a closing marker of the protocol, or at eos / the chat
template's end of turn), the environment runs it, and the tool output, rendered by the
tokenizer's chat format, is appended with `continue_request`, so only new tokens are prefilled. An episode becomes
one `Sequence`: policy tokens are trainable with the sampler's log-probs, versions and routed
experts; prompt and tool output are context. Episodes run side by side, as many as the engine
has slots (a parked episode holds its slot until it ends), and a slot freed by a finished
episode takes the next one at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import heapq
import logging
from collections.abc import Callable

import numpy as np

from composer_jax.actor.feedback import teacher_sequence
from composer_jax.data.chat import OBSERVATION, ChatFormat, Segment, chat_format_for
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.envs import EnvConfig, Episode, StepResult, Task, protocol
from composer_jax.infer import Completion, InferenceEngine, SamplingParams
from composer_jax.rl.batch import SegmentKind, Sequence, TrajectoryBatch, pack_trajectories

log = logging.getLogger(__name__)

# A turn ends after a tool call (the environment must answer it) or the final message.
TURN_END_MARKERS = (protocol.CALL_CLOSE, protocol.FINAL_CLOSE)
_SPANS = (
    (protocol.THINK_OPEN, protocol.THINK_CLOSE, SegmentKind.THINKING),
    (protocol.CALL_OPEN, protocol.CALL_CLOSE, SegmentKind.TOOL_CALL),
    (protocol.FINAL_OPEN, protocol.FINAL_CLOSE, SegmentKind.FINAL_MESSAGE),
)


def sampler_engine(model, rl, tokenizer: Tokenizer, **overrides) -> InferenceEngine:
    """An InferenceEngine with the RL sampler's settings (`rl`: an RLConfig): its slots, context,
    prefill buckets and decode steps per call; `overrides` go to the engine."""
    settings = dict(
        num_slots=rl.num_slots,
        max_len=rl.context_len,
        prefill_buckets=tuple(sorted({*rl.prefill_buckets, rl.context_len})),
        decode_chunk=rl.decode_chunk,
        tokenizer=tokenizer,
    )
    return InferenceEngine(model, **{**settings, **overrides})


def turn_sampling(
    params: SamplingParams, chat: ChatFormat, markers: tuple[str, ...] = TURN_END_MARKERS
) -> SamplingParams:
    """`params` that end a turn at the protocol's closing markers (by text, so any tokenization
    of them stops) and at the chat format's end-of-turn tokens."""
    return dataclasses.replace(
        params,
        stop_sequences=tuple((i,) for i in chat.stop_token_ids),
        stop_strings=markers,
        tokenizer=chat.tokenizer.spec,
    )


def segment_kind(segment: Segment) -> SegmentKind:
    """Tool output counts as such for the length penalty; the chat scaffolding is prompt."""
    return SegmentKind.TOOL_OUTPUT if segment.role == OBSERVATION else SegmentKind.PROMPT


def text_kinds(text: str) -> np.ndarray:
    """SegmentKind per character of an agent turn. Untagged text counts as thinking, as the
    environment's counts do; an unclosed tag runs to the end."""
    kinds = np.full(len(text), SegmentKind.THINKING, np.int32)
    pos = 0
    while pos < len(text):
        found = [(text.find(o, pos), o, c, k) for o, c, k in _SPANS]
        found = [f for f in found if f[0] >= 0]
        if not found:
            break
        start, _, close, kind = min(found)
        end = text.find(close, start)
        end = len(text) if end < 0 else end + len(close)
        kinds[start:end] = kind
        pos = end
    return kinds


def token_kinds(tokens: list[int], tokenizer: Tokenizer) -> np.ndarray:
    """Kinds of generated tokens: each token takes the kind of the first character it adds to
    the turn's text (`Tokenizer.token_texts`; a token that adds nothing, e.g. the first bytes of
    a character or a special token, takes the kind of the text at its place)."""
    pieces = tokenizer.token_texts(tokens)
    kinds = text_kinds("".join(pieces))
    starts = np.cumsum([0] + [len(p) for p in pieces[:-1]])
    if len(kinds) == 0:
        return np.full(len(tokens), SegmentKind.THINKING, np.int32)
    return kinds[np.minimum(starts, len(kinds) - 1)].astype(np.int32)


@dataclasses.dataclass(kw_only=True, eq=False)
class Generation:
    """One generation's growing token buffers, in the engine's token order."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    kinds: list[int] = dataclasses.field(default_factory=list)
    policy: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    routes: list[np.ndarray] = dataclasses.field(default_factory=list)  # [moe_layers, k] each

    def add_context(self, tokens, kind: SegmentKind) -> None:
        self.tokens += [int(t) for t in tokens]
        self.kinds += [int(kind)] * len(tokens)
        self.policy += [False] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [0] * len(tokens)

    def add_turn(self, completion: Completion, kinds) -> None:
        """Generated tokens, and the routes of the positions prefilled for this turn. The engine
        reports token i's experts at the position that produced it (i - 1); the turn's last token
        is routed when the next turn prefills it, so it appears in that turn's prompt_experts."""
        self.routes += [np.asarray(e) for e in completion.prompt_experts]
        self.routes += [np.asarray(e) for e in completion.experts[1:]]
        self.tokens += completion.tokens
        self.kinds += [int(k) for k in kinds]
        self.policy += [True] * len(completion.tokens)
        self.logprobs += completion.logprobs
        self.versions += completion.versions

    def to_sequence(self, sample_index: int, num_moe_layers: int, k: int, flagged=()) -> Sequence:
        """The generation as a Sequence. Every position but the last is routed; the last token
        predicts nothing and gets experts 0..k-1, as the packer gives padding. `flagged`: turns
        (start, end, hint tokens) whose hinted teacher context is attached."""
        if len(self.routes) != len(self.tokens) - 1:
            raise RuntimeError(f"{len(self.routes)} routes for {len(self.tokens)} tokens")
        filler = np.broadcast_to(np.arange(k, dtype=np.int32), (num_moe_layers, k))
        tokens = np.asarray(self.tokens, np.int32)
        teacher_tokens = teacher_index = None
        if flagged:
            teacher_tokens, teacher_index = teacher_sequence(tokens, list(flagged))
        return Sequence(
            sample_index=sample_index,
            tokens=tokens,
            kinds=np.asarray(self.kinds, np.int32),
            policy_mask=np.asarray(self.policy, bool),
            sampler_logprobs=np.asarray(self.logprobs, np.float32),
            policy_versions=np.asarray(self.versions, np.int32),
            router_indices=np.stack(self.routes + [filler], axis=1).astype(np.int32),
            teacher_tokens=teacher_tokens,
            teacher_target_index=teacher_index,
        )


@dataclasses.dataclass(kw_only=True, eq=False)
class EpisodeTrace(Generation):
    """One episode's growing sequence and what the environment said at its end."""

    episode: Episode
    params: SamplingParams
    request_id: int = -1
    done: bool = False
    truncated: bool = False
    reward: float = 0.0
    counts: dict = dataclasses.field(default_factory=dict)
    flags: tuple = ()  # reward-hack monitor flags
    grade: dict | None = None  # the grader's result (outcomes, scores) when the episode ended

    @property
    def generated_tokens(self) -> int:
        return sum(self.policy)


def play_episodes(
    engine: InferenceEngine,
    tasks: list[Task],
    sampling: SamplingParams,
    max_turns: int,
    tokenizer: Tokenizer,
    env_config: EnvConfig,
    first_seed: int,
    env_threads: int = 1,
    on_finish: Callable[[EpisodeTrace], None] | None = None,
    step: Callable[[Episode, str], StepResult] = Episode.step,
    env_lag_steps: int = 8,
) -> list[EpisodeTrace]:
    """Plays one episode per task, as many side by side as the engine has slots: a finished
    episode's slot takes the next task, and each turn's environment step (tool commands,
    grading) runs on one of `env_threads` threads while the engine decodes the other episodes.

    The episode of task i is seeded first_seed + i, and the schedule does not depend on timing:
    a step's result is taken `env_lag_steps` engine steps after its turn ended (waiting for it
    then if it is late), so every run batches the same requests together and samples the same
    tokens. `on_finish(trace)` is called as each episode ends; `step(episode, text)` is the
    environment step (e.g. wrapped to time it)."""
    config = dataclasses.replace(env_config, max_turns=max_turns)  # the last turn is graded
    chat = chat_format_for(tokenizer)
    base = turn_sampling(sampling, chat)
    traces: list[EpisodeTrace] = []
    waiting = collections.deque(enumerate(tasks))
    generating: dict[int, EpisodeTrace] = {}  # engine request id -> its episode
    # Environment steps in flight, each due `env_lag_steps` engine steps after its turn ended:
    # (due step, order, future, trace, completion).
    stepping: list[tuple[int, int, concurrent.futures.Future, EpisodeTrace, Completion]] = []
    holding = 0  # episodes holding a slot: generating, or parked while their environment steps
    engine_steps = turns = 0

    def finish(trace: EpisodeTrace) -> None:
        trace.done = True
        trace.episode.close()
        if on_finish is not None:
            on_finish(trace)

    pool = concurrent.futures.ThreadPoolExecutor(env_threads, thread_name_prefix="episode-step")
    try:
        while waiting or generating or stepping:
            while waiting and holding < engine.num_slots:
                index, task = waiting.popleft()
                params = dataclasses.replace(base, seed=first_seed + index, keep_cache=True)
                trace = EpisodeTrace(episode=Episode(task, config), params=params)
                traces.append(trace)
                prompt = chat.prompt(trace.episode.prompt)
                trace.add_context(prompt, SegmentKind.PROMPT)
                if len(prompt) + 1 >= engine.max_len:  # no room to answer: reward 0
                    log.warning(
                        "task %s: its prompt (%d tokens) leaves no room to answer in a context "
                        "of %d; it scores 0 (raise rl.context_len)",
                        task.task_id,
                        len(prompt),
                        engine.max_len,
                    )
                    trace.truncated = True
                    finish(trace)
                    continue
                trace.request_id = engine.submit(prompt, trace.params)
                generating[trace.request_id] = trace
                holding += 1
            if generating:
                for request_id in engine.step():
                    trace = generating.pop(request_id)
                    completion = engine.completions.pop(request_id)
                    trace.add_turn(completion, token_kinds(completion.tokens, tokenizer))
                    future = pool.submit(step, trace.episode, tokenizer.decode(completion.tokens))
                    due = engine_steps + env_lag_steps
                    heapq.heappush(stepping, (due, turns, future, trace, completion))
                    turns += 1
                engine_steps += 1
            else:  # nothing to decode: on to the next step's result
                engine_steps = max(engine_steps, stepping[0][0])
            while stepping and stepping[0][0] <= engine_steps:
                _, _, future, trace, completion = heapq.heappop(stepping)
                if _next_turn(engine, chat, trace, completion, future.result()):
                    generating[trace.request_id] = trace
                else:
                    engine.release(trace.request_id)
                    holding -= 1
                    finish(trace)
        return traces  # started, and so listed, in the order of `tasks`
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for trace in traces:
            trace.episode.close()


def _next_turn(engine, chat: ChatFormat, trace: EpisodeTrace, completion, result) -> bool:
    """Records an environment step's result; when the episode goes on, appends the tool output
    to its context and queues its next turn (True)."""
    trace.counts, trace.reward = result.counts, result.reward
    segments = chat.after_turn(result.observation, completion.tokens)
    appended = [i for segment in segments for i in segment.ids]
    full = completion.finish_reason == "max_len"
    if full or len(trace.tokens) + len(appended) + 1 >= engine.max_len:
        trace.truncated = not result.done  # no room for another turn: reward 0
    if result.done or trace.truncated:
        trace.flags, trace.grade = result.flags, result.info.get("grade")
        return False
    for segment in segments:
        trace.add_context(segment.ids, segment_kind(segment))
    trace.request_id = engine.continue_request(trace.request_id, appended, trace.params)
    return True


def collect_group(
    engine: InferenceEngine,
    task: Task,
    group_size: int,
    sampling: SamplingParams,
    max_turns: int,
    tokenizer: Tokenizer,
    env_config: EnvConfig = EnvConfig(),
    first_sample: int = 0,
) -> tuple[list[Sequence], dict[str, np.ndarray]]:
    """`group_size` episodes of one task. Returns their sequences (sample indices from
    `first_sample`) and per-sample arrays: "reward" (the episode's), "num_tool_calls",
    "num_turns", "truncated"."""
    traces = play_episodes(
        engine, [task] * group_size, sampling, max_turns, tokenizer, env_config, sampling.seed
    )
    return _sequences(engine, traces, first_sample), episode_stats(traces)


def _sequences(engine: InferenceEngine, traces, first_sample: int = 0) -> list[Sequence]:
    cfg = engine.cfg
    return [
        t.to_sequence(first_sample + i, cfg.num_moe_layers, cfg.num_experts_per_tok)
        for i, t in enumerate(traces)
    ]


def episode_stats(traces: list[EpisodeTrace]) -> dict[str, np.ndarray]:
    """Per-sample reward, tool calls, turns and truncation of played episodes."""
    return {
        "reward": np.array([t.reward for t in traces], np.float32),
        "num_tool_calls": np.array([t.counts.get("tool_calls", 0) for t in traces], np.float32),
        "num_turns": np.array([t.counts.get("turns", 0) for t in traces], np.float32),
        "truncated": np.array([t.truncated for t in traces], bool),
    }


def play_groups(
    engine: InferenceEngine,
    tasks: list[Task],
    group_size: int,
    sampling: SamplingParams,
    max_turns: int,
    tokenizer: Tokenizer,
    env_config: EnvConfig = EnvConfig(),
    env_threads: int = 1,
) -> list[EpisodeTrace]:
    """`group_size` episodes of every task (`play_episodes`: slots refilled as episodes end);
    sample i (task i // group_size) is seeded sampling.seed + i."""
    if group_size < 1:
        raise ValueError(f"group_size {group_size} must be >= 1")
    episodes = [task for task in tasks for _ in range(group_size)]
    return play_episodes(
        engine, episodes, sampling, max_turns, tokenizer, env_config, sampling.seed, env_threads
    )


def collect_batch(
    engine: InferenceEngine,
    tasks: list[Task],
    group_size: int,
    sampling: SamplingParams,
    max_turns: int,
    tokenizer: Tokenizer,
    seq_len: int | None = None,
    num_rows: int | None = None,
    env_config: EnvConfig = EnvConfig(),
) -> tuple[TrajectoryBatch, dict[str, np.ndarray]]:
    """One group per task, packed into rows of `seq_len` (default: the engine's max_len). Groups
    run in waves of as many as fit in the engine's slots. Returns the batch (reward component
    "task") and the per-sample stats of `episode_stats`."""
    traces = play_groups(engine, tasks, group_size, sampling, max_turns, tokenizer, env_config)
    sequences = _sequences(engine, traces)
    stats = episode_stats(traces)
    batch = pack_trajectories(
        sequences,
        group_id=np.repeat(np.arange(len(tasks), dtype=np.int32), group_size),
        rewards={"task": stats["reward"]},
        seq_len=seq_len or engine.max_len,
        num_rows=num_rows,
        num_tool_calls=stats["num_tool_calls"],
        num_turns=stats["num_turns"],
    )
    return batch, stats
