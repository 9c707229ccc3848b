"""The synchronous driver: tiny-model episodes on built-in tasks, played through the workflow,
become a trainable batch; the schedule does not depend on the environment's timing."""

import dataclasses
import random
import time

import jax
import numpy as np
import pytest
from flax import nnx

from composer_jax import agent, config, presets
from composer_jax.actor.evaluator import Evaluator
from composer_jax.agent.kinds import text_kinds, token_kinds
from composer_jax.data import ByteTokenizer
from composer_jax.data.chat import chat_format_for
from composer_jax.envs import EnvConfig, Episode, builtin_tasks, episode_prompt, render_turn
from composer_jax.infer import InferenceEngine, SamplingParams
from composer_jax.model import init_model
from composer_jax.rl import RLObjectiveConfig, SegmentKind, reference_logprobs, rl_loss

MAX_NEW = 48
TEMPERATURE = 0.7  # the trainer's policy is the sampler's distribution at this temperature


@pytest.fixture(scope="module")
def model():
    return init_model(dataclasses.replace(presets.tiny().model, dtype="float32"), 0)


def _workflow(model, max_turns, max_len, sampling, env=None):
    """The built-in workflow over `model` for episodes of at most `max_turns` turns (distilling,
    as the default objective does)."""
    cfg = config.AgentConfig(max_turns=max_turns)
    env = env or agent.env_config(cfg)
    workflow = agent.make_workflow(
        cfg, ByteTokenizer(), model.cfg, env, max_len=max_len, sampling=sampling, distill=True
    )
    return workflow, env


def test_token_kinds_follow_the_protocol():
    turn = render_turn("plan", (("run_tests", {}),), "done")
    kinds = token_kinds(ByteTokenizer().encode("x" + turn), ByteTokenizer())
    want = np.concatenate([[SegmentKind.THINKING], text_kinds(turn)])
    np.testing.assert_array_equal(kinds, want)
    assert kinds[1 : 1 + len("<think>plan</think>")].tolist() == [SegmentKind.THINKING] * 19
    call_start = turn.index("<call")
    assert kinds[1 + call_start] == SegmentKind.TOOL_CALL
    assert kinds[1 + turn.index("</call>") + 6] == SegmentKind.TOOL_CALL
    assert kinds[-1] == SegmentKind.FINAL_MESSAGE


def test_collect_batch_trains(model):
    cfg = model.cfg
    engine = InferenceEngine(model, num_slots=4, max_len=768, prefill_buckets=(64, 512))
    tokenizer = ByteTokenizer()
    tasks = builtin_tasks(2, "train", seed=0)
    sampling = SamplingParams(temperature=TEMPERATURE, max_new_tokens=MAX_NEW, seed=3)
    generated = []
    original_step = engine.step

    def step_and_record():
        finished = original_step()
        generated.extend(engine.completions[i] for i in finished)
        return finished

    engine.step = step_and_record
    workflow, env = _workflow(model, 2, engine.max_len, sampling)
    batch, stats = agent.collect_batch(engine, tasks, 2, workflow, env)
    assert tokenizer.vocab_size == cfg.vocab_size

    assert batch.num_samples == 4
    np.testing.assert_array_equal(batch.group_id_N, [0, 0, 1, 1])
    rewards = np.asarray(batch.rewards_N["task"])
    assert ((rewards >= 0) & (rewards <= 1)).all()
    assert (stats["num_turns"] >= 1).all() and (stats["num_turns"] <= 2).all()
    assert (stats["num_turns"] == 2).any()  # a continuation ran, after tool output
    assert (np.asarray(batch.kinds_BT) == SegmentKind.TOOL_OUTPUT).any()
    # Trainable tokens are exactly the generated ones: each turn is one run of the policy mask, with
    # the engine's tokens, log-probs and versions, and the experts that routed the position before.
    mask = np.asarray(batch.policy_mask_BT)
    tokens, logprobs = np.asarray(batch.tokens_BT), np.asarray(batch.sampler_logprobs_BT)
    router = np.asarray(batch.router_indices_LBTK)
    runs = {}
    for row in range(mask.shape[0]):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask[row].astype(int), [0]])))
        for start, end in zip(edges[::2], edges[1::2]):
            runs[tuple(tokens[row, start:end])] = (row, start, end)
    turns = {id(c): c for c in generated}.values()
    assert sorted(runs) == sorted(tuple(c.tokens) for c in turns)
    for c in turns:
        row, start, end = runs[tuple(c.tokens)]
        np.testing.assert_array_equal(logprobs[row, start:end], np.float32(c.logprobs))
        np.testing.assert_array_equal(router[:, row, start - 1 : end - 1], np.stack(c.experts, 1))
    assert (np.asarray(batch.policy_versions_BT)[mask] == engine.version).all()
    kinds = np.asarray(batch.kinds_BT)
    in_seq = np.asarray(batch.segment_ids_BT) > 0
    assert (kinds[in_seq & ~mask] != SegmentKind.THINKING).all()
    assert np.isin(
        kinds[mask], [SegmentKind.THINKING, SegmentKind.TOOL_CALL, SegmentKind.FINAL_MESSAGE]
    ).all()
    assert batch.router_indices_LBTK.shape[0] == cfg.num_moe_layers

    objective = RLObjectiveConfig(max_generation_len=2 * MAX_NEW)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_and_grads(temperature):
        # The reference is the policy itself here: the KL starts at 0.
        reference = reference_logprobs(model, batch, temperature)

        def loss_fn(p):
            m = nnx.merge(graphdef, p, rest)
            return rl_loss(m, batch, objective, reference, temperature=temperature)

        return jax.value_and_grad(loss_fn, has_aux=True)(params)

    (loss, metrics), grads = loss_and_grads(TEMPERATURE)
    assert np.isfinite(float(loss))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    # The sampler's policy is the trainer's (same weights, same temperature, experts replayed):
    # every trained token's log-prob lines up with the one it was sampled with, and the KL to
    # the policy itself is zero (a token or log-prob shifted by one position would not be).
    np.testing.assert_allclose(metrics["importance_ratio_max"], 1.0, atol=1e-3)
    np.testing.assert_allclose(metrics["importance_ratio_mean"], 1.0, atol=1e-3)
    np.testing.assert_allclose(metrics["kl_k1"], 0.0, atol=1e-5)
    # The untempered policy is another distribution: its ratios to the sampler's are not 1.
    (_, untempered), _ = loss_and_grads(1.0)
    assert float(untempered["importance_ratio_max"]) > 1.5


def test_slots_refill_on_a_schedule_that_environment_timing_does_not_change(model):
    """Six two-turn episodes on 4 slots with environment steps delayed at random: a finished
    episode's slot takes the next one (the engine never queues a request for want of a slot),
    every episode plays out, and two runs submit every turn at the same engine step, so they
    batch the same requests together and sample the same tokens."""
    tasks = builtin_tasks(3, "train", seed=2) * 2
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5)

    def play(delay_seed: int):
        engine = InferenceEngine(model, num_slots=4, max_len=768, prefill_buckets=(64, 512))
        schedule, steps = [], [0]
        step, submit, continue_request = engine.step, engine.submit, engine.continue_request

        def counted_step():
            finished = step()
            steps[0] += 1
            assert not engine._queue, "a request waited for a slot"
            return finished

        def recorded_submit(prompt, params):
            schedule.append(("submit", steps[0], params.seed))
            return submit(prompt, params)

        def recorded_continue(request_id, appended, params):
            schedule.append(("continue", steps[0], params.seed))
            return continue_request(request_id, appended, params)

        engine.step, engine.submit = counted_step, recorded_submit
        engine.continue_request = recorded_continue
        delays = random.Random(delay_seed)

        def late_step(episode, text):
            time.sleep(delays.uniform(0.0, 0.06))
            return Episode.step(episode, text)

        workflow, env = _workflow(model, 2, engine.max_len, sampling)
        jobs = [(task, f"job{i}") for i, task in enumerate(tasks)]
        outcomes = agent.play(engine, jobs, workflow, env, env_threads=2, step=late_step)
        return schedule, outcomes

    (schedule, outcomes), (again, outcomes_again) = play(0), play(1)
    seeds = [seed for kind, _, seed in schedule if kind == "submit"]
    assert len(set(seeds)) == 6  # one seed per episode, from its key
    assert all(o is not None and o.sequences for o in outcomes)
    assert [kind for kind, _, _ in schedule].count("submit") == 6
    assert "continue" in {kind for kind, _, _ in schedule}  # a second turn ran
    assert max(step for kind, step, _ in schedule if kind == "submit") > 0  # a slot was refilled
    assert schedule == again
    tokens = [[s.tokens.tolist() for s in o.sequences] for o in outcomes]
    assert tokens == [[s.tokens.tolist() for s in o.sequences] for o in outcomes_again]
    assert [o.reward for o in outcomes] == [o.reward for o in outcomes_again]


def test_group_samples_differ_and_free_the_engine(model):
    engine = InferenceEngine(model, num_slots=2, max_len=768, prefill_buckets=(64, 512))
    task = builtin_tasks(1, "train", seed=1)[0]
    sampling = SamplingParams(max_new_tokens=16, seed=0)
    workflow, env = _workflow(model, 1, engine.max_len, sampling)
    outcomes = agent.play(engine, agent.group_jobs([task], 2), workflow, env)
    sequences = [s for o in outcomes for s in o.sequences]
    assert len(sequences) == 2
    first, second = (s.tokens[s.policy_mask] for s in sequences)
    assert not np.array_equal(first, second)
    assert not engine.has_work and all(s is None for s in engine._slots)
    for s in sequences:
        assert s.router_indices.shape == (model.cfg.num_moe_layers, len(s), 2)


def test_episode_without_room_for_a_turn_is_truncated(model):
    engine = InferenceEngine(model, num_slots=2, max_len=400, prefill_buckets=(64, 512))
    task = builtin_tasks(1, "train", seed=0)[0]
    sampling = SamplingParams(max_new_tokens=MAX_NEW, seed=0)
    workflow, env = _workflow(model, 4, engine.max_len, sampling)
    outcomes = agent.play(engine, agent.group_jobs([task], 2), workflow, env)
    sequences = [s for o in outcomes for s in o.sequences]
    stats = agent.episode_stats(outcomes)
    assert stats["truncated"].all() and (stats["reward"] == 0).all()
    assert all(len(s) < engine.max_len for s in sequences)
    assert all(s is None for s in engine._slots)


def test_a_prompt_without_room_is_abandoned_and_left_out_of_the_advantages(model):
    """A training prompt longer than the context scores 0 without the policy acting: its samples
    are abandoned (group id -1 in the batch, no advantage), the other task's group trains."""
    chat = chat_format_for(ByteTokenizer())
    env = EnvConfig(max_turns=1)
    tasks = sorted(
        builtin_tasks(4, "train", seed=0),
        key=lambda task: len(chat.prompt(episode_prompt(task, env))),
    )
    short, long = tasks[0], tasks[-1]
    max_len = len(chat.prompt(episode_prompt(short, env))) + 16
    engine = InferenceEngine(model, num_slots=4, max_len=max_len, prefill_buckets=(64, 512))
    sampling = SamplingParams(max_new_tokens=8, seed=0)
    workflow, env = _workflow(model, 1, engine.max_len, sampling)
    batch, stats = agent.collect_batch(engine, [short, long], 2, workflow, env)
    np.testing.assert_array_equal(stats["abandoned"], [False, False, True, True])
    np.testing.assert_array_equal(batch.group_id_N, [0, 0, -1, -1])


def test_evaluation_scores_prompts_without_room_as_zero_and_says_so(model, caplog):
    """A held-out prompt longer than the context scores 0 with a warning naming it and
    rl.rollout.context_len; the evaluation still plays the other tasks (it used to fail building
    sequences)."""
    chat = chat_format_for(ByteTokenizer())

    def prompt_tokens(task):  # as the rollout renders it
        return len(chat.prompt(episode_prompt(task, EnvConfig(max_turns=1))))

    tasks = sorted(builtin_tasks(4, "train", seed=0), key=prompt_tokens)
    short, long = tasks[0], tasks[-1]
    lengths = prompt_tokens(short), prompt_tokens(long)
    assert lengths[0] + 16 < lengths[1]
    cfg = config.RLConfig(
        rollout=config.RolloutConfig(context_len=lengths[0] + 16, num_slots=4, max_new_tokens=8),
        agent=config.AgentConfig(max_turns=1),
    )
    evaluator = Evaluator(
        cfg, [short, long], ByteTokenizer(), 2, 1.0, agent.env_config(cfg.agent, evaluation=True)
    )
    with caplog.at_level("WARNING"):
        result = evaluator.evaluate(model)
    assert result.per_task.shape == (2,) and result.per_task[1] == 0
    assert result.task_ids == (short.task_id, long.task_id)  # what heldout.json pairs by
    assert f"task {long.task_id}: its prompt ({lengths[1]} tokens)" in caplog.text
    assert short.task_id not in caplog.text and "raise rl.rollout.context_len" in caplog.text
