"""One episode implementation: the asynchronous actor loop and `agent.play` run the same workflow
and produce the same episodes (tokens, summaries, feedback turns, teacher contexts), first with a
scripted policy whose every turn depends on the request's seed, then with a real model; a long
tool output at a summary request leaves the summary its budget; no feedback detector compares a
turn with one from before a summary restart."""

import dataclasses
import random
import re

import numpy as np

from composer_jax import agent, data, envs
from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.sampler import LocalSampler
from composer_jax.actor.samples import group_sequences
from composer_jax.actor.thread_pool import ThreadEnvironmentPool
from composer_jax.agent.workflow import SUMMARY_OPEN
from composer_jax.config import AgentConfig, ModelConfig, RLConfig, RLObjectiveConfig, RolloutConfig
from composer_jax.model import init_model
from composer_jax.rl import SegmentKind
from composer_jax.train.step import split_model
from composer_jax.weight_sync import WeightPublisher, open_store
from tests.actor.scripted import ScriptedEngine, ScriptedSampler, make_coordinator

TOKENIZER = data.get_tokenizer("byte")
MODEL_CFG = ModelConfig()
BAD_CALL = envs.render_call("read_file", {"path": "solution.py", "lines": "3"})
LOOK = envs.render_call("list_dir", {})
FINAL = envs.render_turn(final="Done.")


class SeededScript:
    """A policy whose turns depend on the request's seed: a bad call or a look first, the
    solution, then a final message; a summary whenever one is asked for."""

    def __init__(self, tasks):
        self.tasks = tasks

    def __call__(self, prompt: str, turn: int, seed: int) -> str:
        carried = re.search(r"<summary>steps (\d+)", prompt)  # the progress a summary carried
        done = (int(carried.group(1)) if carried else 0) + prompt.count("<output")
        if prompt.endswith(SUMMARY_OPEN):
            return f"steps {done}, seed {seed % 97}</summary>"
        task = next(t for t in self.tasks if t.prompt.splitlines()[0] in prompt)
        write, final = envs.oracle_turns(task)
        rng = random.Random(seed)
        plan = [rng.choice([BAD_CALL, LOOK]), rng.choice([BAD_CALL, LOOK]), write, final]
        return plan[min(done, len(plan) - 1)]


def _build(cfg: AgentConfig, max_len: int, distill: bool, rollout=RolloutConfig()):
    """(workflow, environment factory) of the agent config on the byte tokenizer."""
    sampling = agent.rollout_sampling(rollout)
    return agent.build(
        cfg, TOKENIZER, MODEL_CFG, max_len=max_len, sampling=sampling, distill=distill
    )


def _async_episodes(cfg, sampler, tasks, tmp_path) -> dict[str, list]:
    """{task id: its group's sequences} from the actor loop, one group of each task."""
    ledger = GroupLedger(tmp_path / "ledger")
    prompts = [(f"p{i}", task) for i, task in enumerate(tasks)]
    with ThreadEnvironmentPool(4, timeout_s=120) as pool:
        coordinator = make_coordinator(cfg, sampler, pool, ledger, prompts)
        coordinator.start()
        try:
            assert sorted(coordinator.wait_for_groups(len(tasks), timeout_s=600)) == [
                p for p, _ in prompts
            ]
        finally:
            coordinator.stop()
    return {name: ledger.load(name) for name, _ in prompts}


def _played(cfg, engine, tasks) -> dict[str, list]:
    """The same episodes through agent.play: the keys are the actor loop's episode ids."""
    workflow, env = _build(
        cfg.agent, cfg.rollout.context_len, cfg.objective.distill_coef > 0, cfg.rollout
    )
    jobs = [
        (task, f"p{i}-s{j}-a0")
        for i, task in enumerate(tasks)
        for j in range(cfg.rollout.group_size)
    ]
    outcomes = agent.play(engine, jobs, workflow, env, env_threads=2)
    return {
        f"p{i}": outcomes[i * cfg.rollout.group_size : (i + 1) * cfg.rollout.group_size]
        for i in range(len(tasks))
    }


def _assert_same(groups, played):
    for name, group in groups.items():
        sequences = group_sequences(group)
        mine = [s for sample, o in enumerate(played[name]) for s in _indexed(o, sample)]
        assert len(sequences) == len(mine)
        for got, want in zip(sequences, mine):
            assert got.sample_index == want.sample_index
            np.testing.assert_array_equal(got.tokens, want.tokens)
            np.testing.assert_array_equal(got.kinds, want.kinds)
            np.testing.assert_array_equal(got.policy_mask, want.policy_mask)
            assert (got.teacher_tokens is None) == (want.teacher_tokens is None)
            if got.teacher_tokens is not None:
                np.testing.assert_array_equal(got.teacher_tokens, want.teacher_tokens)
                np.testing.assert_array_equal(got.teacher_target_index, want.teacher_target_index)
        assert group.metadata["summaries"] == [o.summaries for o in played[name]]
        assert group.metadata["feedback"] == [o.feedback for o in played[name]]
        np.testing.assert_array_equal(group.rewards, [o.reward for o in played[name]])


def _indexed(outcome, sample):
    return [dataclasses.replace(seq, sample_index=sample) for seq in outcome.sequences]


def test_the_actor_loop_and_play_give_the_same_scripted_episodes(tmp_path):
    tasks = envs.builtin_tasks(2, seed=61, max_ops=1)
    cfg = RLConfig(
        rollout=RolloutConfig(group_size=2, context_len=1024),
        agent=AgentConfig(max_turns=6, summary_budget=560, summary_max_tokens=48),
        objective=RLObjectiveConfig(distill_coef=0.1),
    )
    script = SeededScript(tasks)
    args = dict(moe_layers=MODEL_CFG.num_moe_layers, k=MODEL_CFG.num_experts_per_tok, seeded=True)
    groups = _async_episodes(cfg, ScriptedSampler(script, TOKENIZER, **args), tasks, tmp_path)
    played = _played(cfg, ScriptedEngine(script, TOKENIZER, num_slots=4, **args), tasks)
    _assert_same(groups, played)
    outcomes = [o for group in played.values() for o in group]
    assert sum(o.summaries for o in outcomes) >= 2  # the chains summarised
    assert sum(o.feedback.get("invalid_arguments", 0) for o in outcomes) >= 1
    assert any(s.teacher_tokens is not None for o in outcomes for s in o.sequences)
    first = {
        TOKENIZER.decode(o.sequences[0].tokens[o.sequences[0].policy_mask][:30]) for o in outcomes
    }
    assert len(first) == 2  # the seeds differ per sample, and both drivers used the same ones


def test_the_actor_loop_and_play_sample_the_same_tokens_with_a_real_model(tmp_path):
    """A random tiny model: its turns are noise, so every episode runs to its turn limit and
    summarises as its context grows; one sample per prompt (no prompt is shared between slots,
    whose copy would feed the prompt's last token by a decode step instead of the prefill)."""
    model = init_model(MODEL_CFG, seed=4)
    store = str(tmp_path / "weights")
    with WeightPublisher(open_store(store)) as publisher:
        publisher.publish(split_model(model)[1], 0)
    cfg = RLConfig(
        rollout=RolloutConfig(group_size=1, num_slots=2, context_len=640, max_new_tokens=24),
        agent=AgentConfig(max_turns=5, summary_budget=420, summary_max_tokens=24, max_summaries=2),
    )
    tasks = envs.builtin_tasks(2, seed=62, max_ops=1)

    def sampler():
        local = LocalSampler(model, store, num_slots=2, max_len=cfg.rollout.context_len)
        assert local.sync_weights(wait_for=0) == 0  # the bf16 snapshot both sample from
        return local

    groups = _async_episodes(cfg, sampler(), tasks, tmp_path)
    played = _played(cfg, sampler().engine, tasks)
    _assert_same(groups, played)
    outcomes = [o for group in played.values() for o in group]
    assert all(o.summaries >= 1 for o in outcomes)
    summary = [s for o in outcomes for s in o.sequences if (s.kinds == SegmentKind.SUMMARY).any()]
    assert summary and all(s.policy_mask[s.kinds == SegmentKind.SUMMARY].all() for s in summary)


def test_a_long_output_at_the_summary_request_is_cut_to_leave_the_summary_its_budget():
    """A traceback that takes the context near its end would leave the summary a few tokens: the
    fewest lines of the output after its opening are cut (marked), its end kept."""
    cfg = AgentConfig(max_turns=8, summary_budget=300, summary_max_tokens=100)
    workflow, _ = _build(cfg, max_len=768, distill=False)
    frames = [f'  File "/workspace/a.py", line {i}, in f\n    x = f(x)' for i in range(6)]
    traceback = "\n".join(["Traceback (most recent call last):", *frames])
    observation = envs.render_output(
        "run_tests", f"{traceback}\nRecursionError: maximum recursion depth\n[exit code 1]"
    )

    def summary_request(context_tokens: int, observation: str = observation):
        episode = agent.AgentEpisode(key="k", task_id="t")
        episode.add_context([ord("a")] * context_tokens, SegmentKind.PROMPT)
        action = workflow.on_result(episode, envs.StepResult(observation, False, 0.0, {}, (), {}))
        return action, TOKENIZER.decode(action.appended)

    action, appended = summary_request(100)  # room for the whole output and the summary
    assert observation in appended and action.params.max_new_tokens == 100
    action, appended = summary_request(300)
    assert action.params.max_new_tokens == 100 and appended.endswith(SUMMARY_OPEN)
    cut = int(re.search(r"\[(\d+) lines cut to leave room for the summary\]", appended).group(1))
    assert appended.startswith('\n<output tool="run_tests">\n[')
    assert "RecursionError: maximum recursion depth\n[exit code 1]\n</output>" in appended
    kept = observation.split("\n")
    assert appended.count("x = f(x)") == sum("x = f(x)" in line for line in kept[1 + cut :])
    assert 0 < cut < len(kept) - 4
    room = 768 - 300 - len(TOKENIZER.encode(appended)) - 1
    assert 100 <= room < 100 + len(kept[cut]) + 1  # one line fewer cut would not leave 100
    action, appended = summary_request(500)  # no cut gives the budget: all but the end is cut
    body = appended.split("\n")[2:5]
    assert body == [f"[{len(kept) - 4} lines cut to leave room for the summary]", *kept[-3:-1]]
    assert 8 <= action.params.max_new_tokens < 100
    # A note longer than the lines it would replace is not written.
    short = envs.render_output("run_tests", "a\nAssertionError\n[exit code 1]")
    action, appended = summary_request(560, short)
    assert short in appended and action.params.max_new_tokens == 768 - 560 - len(appended) - 1


def test_no_detector_compares_a_turn_with_one_from_before_a_summary_restart():
    """A failed call, then a final message: without a summary between them the final message
    ignores the error (flagged, hinted for distillation); after a summary restart the failed
    call is gone from the context, so nothing is flagged and no teacher context is built."""
    (task,) = envs.builtin_tasks(1, seed=61, max_ops=1)

    def script(prompt: str, turn: int, seed: int) -> str:
        if prompt.endswith(SUMMARY_OPEN):
            return "The read failed.</summary>"
        return FINAL if "<output" in prompt or "<summary>" in prompt else BAD_CALL

    def played(summary_budget: int):
        cfg = AgentConfig(max_turns=4, summary_budget=summary_budget, summary_max_tokens=48)
        workflow, env = _build(cfg, max_len=1024, distill=True)
        args = dict(moe_layers=MODEL_CFG.num_moe_layers, k=MODEL_CFG.num_experts_per_tok)
        engine = ScriptedEngine(script, TOKENIZER, num_slots=1, seeded=True, **args)
        (outcome,) = agent.play(engine, [(task, "p0-s0-a0")], workflow, env, env_threads=1)
        return outcome

    straight = played(summary_budget=0)
    assert straight.summaries == 0 and straight.feedback.get("ignored_tool_error") == 1
    assert straight.sequences[-1].teacher_tokens is not None
    restarted = played(summary_budget=1)
    assert restarted.summaries == 1 and "ignored_tool_error" not in restarted.feedback
    assert restarted.sequences[-1].teacher_tokens is None
