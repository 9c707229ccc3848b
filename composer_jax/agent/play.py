"""The synchronous driver: one inference engine plays agent episodes through the workflow.

Each episode is one request that keeps its cache slot between turns; the workflow decides every
next context (`composer_jax.agent.workflow`) and this loop only schedules: episodes run side by
side, as many as the engine has slots (a parked episode holds its slot until it ends), a slot
freed by a finished episode takes the next one at once, and each turn's environment step (tool
commands, grading) runs on a thread while the engine decodes the others. Used by the held-out
check, `launch.evaluate` and the tests; the actor loop drives the same workflow asynchronously.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import heapq
from collections.abc import Callable

import numpy as np

from composer_jax.agent.workflow import Continue, EpisodeOutcome, Finish, Restart, Step, Submit
from composer_jax.config import RolloutConfig
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.envs import EnvConfig, Episode, StepResult, Task
from composer_jax.infer import InferenceEngine, SamplingParams
from composer_jax.rl.batch import TrajectoryBatch, pack_trajectories


def sampler_engine(
    model, rollout: RolloutConfig, tokenizer: Tokenizer, **overrides
) -> InferenceEngine:
    """An InferenceEngine with the RL sampler's settings (`rl.rollout`): its slots, context,
    prefill buckets and decode steps per call; `overrides` go to the engine."""
    settings = dict(
        num_slots=rollout.num_slots,
        max_len=rollout.context_len,
        prefill_buckets=tuple(sorted({*rollout.prefill_buckets, rollout.context_len})),
        decode_chunk=rollout.decode_chunk,
        tokenizer=tokenizer,
    )
    return InferenceEngine(model, **{**settings, **overrides})


def rollout_sampling(rollout: RolloutConfig, seed: int = 0) -> SamplingParams:
    """The RL sampler's sampling per turn (`rl.rollout`: temperature, top_p, max_new_tokens);
    every episode's randomness derives from `seed` and its key."""
    return SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        max_new_tokens=rollout.max_new_tokens,
        seed=seed,
    )


def _request(engine: InferenceEngine, action, request_id: int | None) -> int:
    """Sends a request action to the engine; returns the request's new id."""
    if isinstance(action, Submit):
        return engine.submit(action.tokens, action.params)
    if isinstance(action, Continue):
        return engine.continue_request(request_id, action.appended, action.params)
    if isinstance(action, Restart):
        return engine.restart_request(request_id, action.keep, action.appended, action.params)
    raise TypeError(f"{action!r} is not a request")


def play(
    engine: InferenceEngine,
    jobs: list[tuple[Task, str]],
    workflow,
    env_config: EnvConfig,
    env_threads: int = 1,
    on_finish: Callable[[int, EpisodeOutcome], None] | None = None,
    step: Callable[[Episode, str], StepResult] = Episode.step,
    env_lag_steps: int = 8,
) -> list[EpisodeOutcome]:
    """Plays one episode per (task, key) job; returns their outcomes in the order of `jobs`.

    `env_config` is the environment the workflow was built for (its tools and turn limit). The
    key seeds the episode's sampling (see `AgentWorkflow.params_for`), and the schedule does not
    depend on timing: a step's result is taken `env_lag_steps` engine steps after its turn ended
    (waiting for it then if it is late), so every run batches the same requests together and
    samples the same tokens. `on_finish(index, outcome)` is called as each episode ends;
    `step(episode, text)` is the environment step (e.g. wrapped to time it)."""
    episodes: list = [None] * len(jobs)
    outcomes: list[EpisodeOutcome | None] = [None] * len(jobs)
    environments: dict[int, Episode] = {}
    request_of: dict[int, int] = {}  # job index -> its request id
    waiting = collections.deque(enumerate(jobs))
    generating: dict[int, int] = {}  # request id -> job index
    # Environment steps in flight, each due `env_lag_steps` engine steps after its turn ended.
    stepping: list[tuple[int, int, concurrent.futures.Future, int]] = []
    holding = engine_steps = turns = 0

    def finish(index: int) -> None:
        environments.pop(index).close()
        outcomes[index] = workflow.outcome(episodes[index])
        if on_finish is not None:
            on_finish(index, outcomes[index])

    def act(index: int, action) -> None:
        """Does what the workflow answered: a request, an environment step, or the end."""
        nonlocal holding, turns
        if isinstance(action, Step):
            future = pool.submit(step, environments[index], action.text)
            heapq.heappush(stepping, (engine_steps + env_lag_steps, turns, future, index))
            turns += 1
        elif isinstance(action, Finish):
            engine.release(request_of.pop(index))
            holding -= 1
            finish(index)
        else:
            request_of[index] = _request(engine, action, request_of.get(index))
            generating[request_of[index]] = index

    pool = concurrent.futures.ThreadPoolExecutor(env_threads, thread_name_prefix="episode-step")
    try:
        while waiting or generating or stepping:
            while waiting and holding < engine.num_slots:
                index, (task, key) = waiting.popleft()
                environments[index] = environment = Episode(task, env_config)
                episodes[index], action = workflow.begin(task, key, environment.prompt)
                if isinstance(action, Finish):
                    finish(index)
                    continue
                holding += 1
                act(index, action)
            if generating:
                for request_id in engine.step():
                    index = generating.pop(request_id)
                    completion = engine.completions.pop(request_id)
                    act(index, workflow.on_completion(episodes[index], completion))
                engine_steps += 1
            elif stepping:  # nothing to decode: on to the next step's result
                engine_steps = max(engine_steps, stepping[0][0])
            while stepping and stepping[0][0] <= engine_steps:
                _, _, future, index = heapq.heappop(stepping)
                act(index, workflow.on_result(episodes[index], future.result()))
        return outcomes
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for environment in environments.values():
            environment.close()


def group_jobs(tasks: list[Task], group_size: int) -> list[tuple[Task, str]]:
    """`group_size` jobs per task; sample j of task i has the key "i:j", so the same task list
    played twice (before and after training) draws the same random numbers per sample."""
    if group_size < 1:
        raise ValueError(f"group_size {group_size} must be >= 1")
    return [(task, f"{i}:{j}") for i, task in enumerate(tasks) for j in range(group_size)]


def episode_stats(outcomes: list[EpisodeOutcome]) -> dict[str, np.ndarray]:
    """Per-sample reward, tool calls, turns, summaries, feedback turns, truncation and
    abandonment."""
    return {
        "reward": np.array([o.reward for o in outcomes], np.float32),
        "num_tool_calls": np.array([o.num_tool_calls for o in outcomes], np.float32),
        "num_turns": np.array([o.num_turns for o in outcomes], np.float32),
        "summaries": np.array([o.summaries for o in outcomes], np.float32),
        "feedback_turns": np.array([sum(o.feedback.values()) for o in outcomes], np.float32),
        "truncated": np.array([o.truncated for o in outcomes], bool),
        "abandoned": np.array([o.abandoned for o in outcomes], bool),
    }


def collect_batch(
    engine: InferenceEngine,
    tasks: list[Task],
    group_size: int,
    workflow,
    env_config: EnvConfig,
    seq_len: int | None = None,
    num_rows: int | None = None,
) -> tuple[TrajectoryBatch, dict[str, np.ndarray]]:
    """One group per task, packed into rows of `seq_len` (default: the engine's max_len).
    Returns the batch (reward component "task") and the per-sample stats of `episode_stats`."""
    outcomes = play(engine, group_jobs(tasks, group_size), workflow, env_config)
    sequences = [
        dataclasses.replace(seq, sample_index=i)
        for i, outcome in enumerate(outcomes)
        for seq in outcome.sequences
    ]
    stats = episode_stats(outcomes)
    batch = pack_trajectories(
        sequences,
        # An abandoned sample (`EpisodeOutcome.abandoned`) stays out of its group's advantages.
        group_id=np.where(
            stats["abandoned"], -1, np.repeat(np.arange(len(tasks), dtype=np.int32), group_size)
        ),
        rewards={"task": stats["reward"]},
        seq_len=seq_len or engine.max_len,
        num_rows=num_rows,
        num_tool_calls=stats["num_tool_calls"],
        num_turns=stats["num_turns"],
    )
    return batch, stats
