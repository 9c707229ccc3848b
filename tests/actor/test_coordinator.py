"""The coordinator's rollout mechanics: text feedback, self-summarisation, worker failures,
scheduling against the sampler's slots."""

import concurrent.futures
import os
import signal
import time

import numpy as np
import pytest

from composer_jax import data, envs
from composer_jax.actor.env_workers import ProcessEnvironmentPool, failed_future
from composer_jax.actor.ids import GroupId
from composer_jax.actor.inflight import GroupState, InFlightStore
from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.lifecycle import SampleState
from composer_jax.actor.report import group_metrics
from composer_jax.actor.sampler import LocalSampler
from composer_jax.actor.samples import group_sequences, groups_to_batch
from composer_jax.actor.thread_pool import ThreadEnvironmentPool
from composer_jax.agent import feedback
from composer_jax.agent.workflow import SUMMARY_OPEN
from composer_jax.config import AgentConfig, ModelConfig, RLConfig, RLObjectiveConfig, RolloutConfig
from composer_jax.envs.grading import protocol
from composer_jax.model import init_model
from composer_jax.rl import SegmentKind
from composer_jax.rl.advantages import per_sample_sum
from composer_jax.rl.loss import distillation_token_kl
from composer_jax.rl.policy import rl_loss, teacher_logits, trainer_logits
from composer_jax.train.step import split_model
from composer_jax.weight_sync import WeightPublisher, open_store
from tests.actor.scripted import ScriptedSampler, make_coordinator

TOKENIZER = data.get_tokenizer("byte")
MODEL_CFG = ModelConfig()
BAD_CALL = '<call tool="launch_rockets"><arg name="count">3</arg></call>'


def _run_one_group(cfg, sampler, pool, ledger, task, timeout_s=120):
    coordinator = make_coordinator(cfg, sampler, pool, ledger, [("p0", task)])
    coordinator.start()
    try:
        ids = coordinator.wait_for_groups(1, timeout_s=timeout_s)
    finally:
        coordinator.stop()
    assert ids == ["p0"]
    return coordinator, ledger.load("p0")


def test_planted_bad_tool_call_is_distilled_on_that_turn_alone(tmp_path):
    task = envs.builtin_tasks(1, seed=21, max_ops=1)[0]
    turns = [BAD_CALL, *envs.oracle_turns(task)]
    sampler = ScriptedSampler(
        lambda prompt, turn: turns[turn],
        TOKENIZER,
        moe_layers=MODEL_CFG.num_moe_layers,
        k=MODEL_CFG.num_experts_per_tok,
    )
    cfg = RLConfig(
        rollout=RolloutConfig(group_size=2, groups_per_step=1, context_len=1024),
        agent=AgentConfig(max_turns=4),
    )
    with ThreadEnvironmentPool(4, timeout_s=60) as pool:
        coordinator, group = _run_one_group(
            cfg, sampler, pool, GroupLedger(tmp_path / "ledger"), task
        )
    np.testing.assert_array_equal(group.rewards, [1.0, 1.0])
    assert group.metadata["feedback"] == [{"unknown_tool": 1}] * 2
    assert coordinator.snapshot()["feedback/unknown_tool"] == 2

    hint_marker = feedback.render_hint([("unknown_tool", "x")]).split("x")[0]
    for seq in group_sequences(group):
        student_text = TOKENIZER.decode(seq.tokens)
        teacher_text = TOKENIZER.decode(seq.teacher_tokens)
        assert hint_marker not in student_text and hint_marker in teacher_text
        distilled = seq.teacher_target_index >= 0
        assert TOKENIZER.decode(seq.tokens[distilled]) == BAD_CALL  # that turn, nothing else
        np.testing.assert_array_equal(
            seq.teacher_tokens[seq.teacher_target_index[distilled]], seq.tokens[distilled]
        )

    batch = groups_to_batch([group], 1024)
    model = init_model(MODEL_CFG, seed=3)
    logits, _ = trainer_logits(model, batch)
    per_token = distillation_token_kl(logits, teacher_logits(model, batch), batch.teacher_index_BT)
    per_token = np.asarray(per_token)
    policy_turn = np.asarray(batch.teacher_index_BT) >= 0
    assert per_token[policy_turn].min() > 0  # the hint changes the teacher on every such token
    assert np.all(per_token[~policy_turn] == 0)
    _, metrics = rl_loss(model, batch, RLObjectiveConfig(distill_coef=1.0, kl_coef=0.0))
    assert float(metrics["distill_loss"]) > 0


def _publish_random_model(tmp_path, seed=0):
    model = init_model(MODEL_CFG, seed=seed)
    store = str(tmp_path / "weights")
    with WeightPublisher(open_store(store)) as publisher:
        publisher.publish(split_model(model)[1], 0)
    return model, store


def test_rollout_summarises_repeatedly_and_trains_the_chain_as_one_sample(tmp_path):
    model, store = _publish_random_model(tmp_path)
    cfg = RLConfig(
        rollout=RolloutConfig(
            group_size=2, groups_per_step=1, num_slots=2, context_len=640, max_new_tokens=24
        ),
        agent=AgentConfig(
            max_turns=10,
            summary_budget=380,
            summary_max_tokens=24,
            max_summaries=3,
            feedback_detectors=(),
        ),
    )
    sampler = LocalSampler(model, store, num_slots=2, max_len=cfg.rollout.context_len)
    assert sampler.sync_weights(wait_for=0) == 0
    task = envs.builtin_tasks(1, seed=5, max_ops=1)[0]
    with ThreadEnvironmentPool(4, timeout_s=60) as pool:
        coordinator, group = _run_one_group(
            cfg, sampler, pool, GroupLedger(tmp_path / "ledger"), task, timeout_s=300
        )
    summaries = group.metadata["summaries"]
    assert min(summaries) >= 2
    sequences = group_sequences(group)
    for sample in range(2):
        chain = [s for s in sequences if s.sample_index == sample]
        assert len(chain) == summaries[sample] + 1
        prompt = chain[0].tokens[: np.argmax(chain[0].policy_mask)]
        for before, after in zip(chain[:-1], chain[1:]):
            summary = before.tokens[before.kinds == SegmentKind.SUMMARY]
            assert (
                len(summary) > 0 and before.policy_mask[before.kinds == SegmentKind.SUMMARY].all()
            )
            # The next generation starts from the task prompt and the summary, as context.
            np.testing.assert_array_equal(after.tokens[: len(prompt)], prompt)
            carried = TOKENIZER.decode(
                after.tokens[len(prompt) :][~after.policy_mask[len(prompt) :]]
            )
            assert carried.startswith(SUMMARY_OPEN + TOKENIZER.decode(summary))
            assert not after.policy_mask[: len(prompt) + len(summary)].any()

    batch = groups_to_batch([group], cfg.rollout.context_len)
    policy_per_sample = per_sample_sum(
        batch.policy_mask_BT.astype(np.float32), batch.sample_index_BT, batch.num_samples
    )
    expected = [
        sum(int(s.policy_mask.sum()) for s in sequences if s.sample_index == i) for i in range(2)
    ]
    np.testing.assert_array_equal(np.asarray(policy_per_sample), expected)
    loss, _ = rl_loss(model, batch, RLObjectiveConfig(kl_coef=0.0))
    assert np.isfinite(float(loss))


# One group of two samples, at most four turns, no feedback detectors.
PAIR = RLConfig(
    rollout=RolloutConfig(group_size=2, groups_per_step=1),
    agent=AgentConfig(max_turns=4, feedback_detectors=()),
)


def _scripted(turns):
    """A sampler that writes `turns` in order, whatever the prompt."""
    return ScriptedSampler(
        lambda prompt, turn: turns[turn],
        TOKENIZER,
        moe_layers=MODEL_CFG.num_moe_layers,
        k=MODEL_CFG.num_experts_per_tok,
    )


@pytest.mark.parametrize("failure", ["kill", "hang"])
def test_environment_worker_failure_requeues_the_sample(tmp_path, failure):
    task = envs.builtin_tasks(1, seed=8, max_ops=1)[0]
    slow = protocol.render_call("run_shell", {"command": "sleep 1.5"})
    turns = [slow, *envs.oracle_turns(task)]
    sampler, cfg = _scripted(turns), PAIR
    pool = ProcessEnvironmentPool(2, timeout_s=3.0 if failure == "hang" else 30.0)
    ledger = GroupLedger(tmp_path / "ledger")
    coordinator = make_coordinator(cfg, sampler, pool, ledger, [("p0", task)])
    try:
        coordinator.start()
        deadline = time.monotonic() + 30
        while pool.health()["calls"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)  # both episodes started and their slow first step sent
        time.sleep(0.3)
        victim = pool.worker_pids()[pool.worker_of("p0-s0-a0")]
        os.kill(victim, signal.SIGKILL if failure == "kill" else signal.SIGSTOP)
        assert coordinator.wait_for_groups(1, timeout_s=120) == ["p0"]
    finally:
        coordinator.stop()
        pool.shutdown()
        if failure == "hang":
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
    np.testing.assert_array_equal(ledger.load("p0").rewards, [1.0, 1.0])
    snapshot = coordinator.snapshot()
    assert snapshot["env_failures"] >= 1 and snapshot["samples_requeued"] >= 1
    key = "env/worker_crashes" if failure == "kill" else "env/worker_timeouts"
    assert snapshot[key] >= 1 and snapshot["env/workers_replaced"] >= 1


class _RefusingPool(ThreadEnvironmentPool):
    """Environments whose every start for sample 1 fails (a sandbox that will not come up)."""

    def start(self, episode_id, task, config=envs.EnvConfig(), snapshot=None):
        if episode_id.startswith("p0-s1"):
            return failed_future(RuntimeError("the sandbox would not start"))
        return super().start(episode_id, task, config, snapshot)


def test_an_abandoned_sample_is_no_reward_measurement(tmp_path):
    """Sample 1's environment never starts: after MAX_ATTEMPTS it is abandoned with reward 0.
    The rollout reward and the trained groups' reward are the measured sample's (1.0, not 0.5),
    and the abandonment is counted."""
    task = envs.builtin_tasks(1, seed=8, max_ops=1)[0]
    turns = envs.oracle_turns(task)
    sampler, cfg = _scripted(turns), PAIR
    with _RefusingPool(2, timeout_s=60) as pool:
        coordinator, group = _run_one_group(
            cfg, sampler, pool, GroupLedger(tmp_path / "ledger"), task
        )
    np.testing.assert_array_equal(group.rewards, [1.0, 0.0])
    assert group.metadata["abandoned"] == [False, True]
    snapshot = coordinator.snapshot()
    assert snapshot["rollout_reward_sum"] == 1.0 and snapshot["rollout_reward_samples"] == 1
    assert snapshot["samples_abandoned"] == 1
    metrics = group_metrics([group], version=0, cfg=cfg)
    assert metrics["reward_mean"] == 1.0 and metrics["pass_rate"] == 1.0
    # A step whose every sample was abandoned measured no reward: it reports none.
    group.metadata["abandoned"] = [True, True]
    assert "reward_mean" not in group_metrics([group], version=0, cfg=cfg)


def _revisits(ledger, prompt):
    """The ledger's groups that revisit `prompt` as a fresh variant (named <prompt>v<n>)."""
    return [g for g in ledger if g.startswith(f"{prompt}v")]


def test_hardest_prompts_are_revisited_late_in_the_epoch(tmp_path):
    tasks = envs.builtin_tasks(4, seed=31, max_ops=1)
    hard = tasks[0].prompt.splitlines()[0]  # the first finished: not merely the latest
    look = protocol.render_call("list_dir", {})

    def script(prompt, turn):
        oracle = envs.oracle_turns(next(t for t in tasks if t.prompt.splitlines()[0] in prompt))
        lead = [look, look] if hard in prompt else []  # the hard prompt takes three more turns
        return (lead + oracle)[turn]

    sampler = ScriptedSampler(
        script, TOKENIZER, moe_layers=MODEL_CFG.num_moe_layers, k=MODEL_CFG.num_experts_per_tok
    )
    cfg = RLConfig(
        rollout=RolloutConfig(
            group_size=2,
            groups_per_step=1,
            num_slots=2,  # one group at a time (until its final turns are graded): in prompt order
            schedule_ahead_groups=0,
            max_staleness=100,
            hard_prompt_fraction=0.99,
        ),
        agent=AgentConfig(max_turns=6, feedback_detectors=()),
    )
    ledger = GroupLedger(tmp_path / "ledger")
    prompts = [(f"p{i}", task) for i, task in enumerate(tasks)]
    variant = envs.load_task_source("builtin:max_ops=1").variant
    with ThreadEnvironmentPool(4, timeout_s=60) as pool:
        coordinator = make_coordinator(cfg, sampler, pool, ledger, prompts, variant=variant)
        coordinator.start()
        try:
            deadline = time.monotonic() + 60
            while not _revisits(ledger, "p0") and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            coordinator.stop()
    assert _revisits(ledger, "p0"), sorted(ledger.pending())
    revisit = ledger.load(_revisits(ledger, "p0")[0])
    # A fresh instance of the hard task (same function, new inputs): a new prompt, never the same
    # one trained twice.
    assert revisit.prompt_id.startswith(tasks[0].task_id + "-v")
    prompt_ids = [ledger.load(g).prompt_id for g in ledger]
    assert len(prompt_ids) == len(set(prompt_ids))
    assert coordinator.snapshot()["revisited_prompts"] >= 1


class _HoldingSampler(ScriptedSampler):
    """Holds every request past the first turn while `held` is set (samples wait between
    turns, as they do while the policy generates)."""

    held = True

    def poll(self, max_steps: int = 8):
        def later_turn(rid):
            return protocol.CALL_OPEN in self.tokenizer.decode(self._requests[rid].context)

        hold = [rid for rid in self._running if self.held and later_turn(rid)]
        self._running = [rid for rid in self._running if rid not in hold]
        done = super().poll(max_steps)
        self._running = hold
        return done


def test_restart_resumes_samples_mid_episode_from_the_in_flight_record(tmp_path):
    """Both samples write the solution, then the run stops while they wait on their second turn.
    A new coordinator resumes them from the record: the environment holds the written file (the
    final turn alone scores 1), the first turn is not generated again and keeps its tokens,
    log-probs and routes, and the chain is one trainable sample."""
    task = envs.builtin_tasks(1, seed=41, max_ops=1)[0]
    write, final = envs.oracle_turns(task)

    def script(prompt, turn):
        return final if protocol.CALL_OPEN in prompt else write

    def make_sampler():
        return _HoldingSampler(script, TOKENIZER, moe_layers=MODEL_CFG.num_moe_layers, k=2)

    cfg = RLConfig(
        rollout=RolloutConfig(group_size=2, groups_per_step=1),
        agent=AgentConfig(max_turns=4, feedback_detectors=()),
    )
    store = InFlightStore(str(tmp_path / "inflight"))
    ledger = GroupLedger(tmp_path / "ledger")
    first_sampler = make_sampler()
    with ThreadEnvironmentPool(2) as pool:
        coordinator = make_coordinator(
            cfg, first_sampler, pool, ledger, [("p0", task)], inflight_store=store
        )
        coordinator.start()
        try:
            deadline = time.monotonic() + 60
            while coordinator.snapshot()["env/calls"] < 4 or any(
                s.state is not SampleState.GENERATING
                for s in coordinator.state.groups[GroupId("p0")].samples
            ):
                assert time.monotonic() < deadline, "the samples never reached their second turn"
                time.sleep(0.02)
            assert coordinator.save_in_flight(3).result(timeout=60) == 2
        finally:
            coordinator.stop()
    saved = store.load(3)
    assert [g.group_id for g in saved] == ["p0"] and len(saved[0].samples) == 2
    recorded = saved[0].samples[0].state  # the workflow episode, between two turns
    generated_before = first_sampler.generated_tokens

    second_sampler = make_sampler()
    second_sampler.held = False
    with ThreadEnvironmentPool(2) as pool:
        coordinator = make_coordinator(
            cfg, second_sampler, pool, ledger, [("p0", task)], resume=saved, inflight_store=store
        )
        coordinator.trainer_version = 3
        coordinator.start()
        try:
            assert coordinator.wait_for_groups(1, timeout_s=60) == ["p0"]
        finally:
            coordinator.stop()
    assert coordinator.snapshot()["samples_resumed"] == 2
    # Only the final turn was generated after the restart.
    assert second_sampler.generated_tokens == 2 * len(TOKENIZER.encode(final))
    assert generated_before == 2 * len(TOKENIZER.encode(write))
    group = ledger.load("p0")
    np.testing.assert_array_equal(group.rewards, [1.0, 1.0])
    sequences = group_sequences(group)
    assert len(sequences) == 2  # one chain per sample
    seq = sequences[0]
    prefix = len(recorded.tokens)
    np.testing.assert_array_equal(seq.tokens[:prefix], recorded.tokens)
    np.testing.assert_array_equal(seq.sampler_logprobs[:prefix], recorded.logprobs)
    np.testing.assert_array_equal(  # [moe_layers, positions, k]
        seq.router_indices[:, : len(recorded.routes)], np.stack(recorded.routes, axis=1)
    )
    policy_text = TOKENIZER.decode(seq.tokens[seq.policy_mask])
    assert policy_text == write + final


class _SelectiveSampler(ScriptedSampler):
    """Finishes the requests `finishes(request_id)` accepts and holds the others forever."""

    def __init__(self, finishes, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.finishes = finishes

    def poll(self, max_steps: int = 8):
        held = [rid for rid in self._running if not self.finishes(rid)]
        self._running = [rid for rid in self._running if self.finishes(rid)]
        done = super().poll(max_steps)
        self._running = held
        return done


class _UngradedPool(ThreadEnvironmentPool):
    """Episodes start, but a turn never comes back from the environment (an endless grading)."""

    def step(self, episode_id, model_output):
        return concurrent.futures.Future()


def _scheduled_groups(finishes, ready, ledger_dir, num_slots, ahead, pool=ThreadEnvironmentPool):
    """Groups of 2 one-turn samples under a sampler that finishes only the requests `finishes`
    accepts: once `ready(state)` holds (within 60 s) and the loop ran on a while, the groups the
    coordinator started and its samples queued for a slot."""
    cfg = RLConfig(
        rollout=RolloutConfig(
            group_size=2,
            groups_per_step=1,
            num_slots=num_slots,
            max_staleness=100,
            schedule_ahead_groups=ahead,
        ),
        agent=AgentConfig(max_turns=1, feedback_detectors=()),
    )
    tasks = envs.builtin_tasks(4, seed=51, max_ops=1)
    write = envs.oracle_turns(tasks[0])[0]
    sampler = _SelectiveSampler(
        finishes,
        lambda prompt, turn: write,
        TOKENIZER,
        num_slots=num_slots,
        moe_layers=MODEL_CFG.num_moe_layers,
        k=MODEL_CFG.num_experts_per_tok,
    )
    prompts = [(f"p{i}", task) for i, task in enumerate(tasks)]
    with pool(4, timeout_s=60) as env_pool:
        coordinator = make_coordinator(cfg, sampler, env_pool, GroupLedger(ledger_dir), prompts)
        state = coordinator.state
        coordinator.start()
        try:
            deadline = time.monotonic() + 60
            while True:
                with state.lock:
                    if ready(state):
                        break
                assert time.monotonic() < deadline, sorted(str(g) for g in state.groups)
                time.sleep(0.02)
            time.sleep(0.5)  # hundreds of loop iterations: time to start anything more
            with state.lock:
                return sorted(str(g) for g in state.groups), len(state.waiting)
        finally:
            coordinator.stop()


@pytest.mark.parametrize("ahead", [0, 1])
def test_groups_start_ahead_of_free_slots(tmp_path, ahead):
    """With every request held, the slots hold one group; `schedule_ahead_groups` more groups
    start their environments and wait for a slot with their prompts ready."""

    def ready(state):
        return len(state.by_request) == 2 and len(state.waiting) == 2 * ahead

    groups, waiting = _scheduled_groups(lambda rid: False, ready, tmp_path, 2, ahead)
    assert groups == ["p0", "p1"][: 1 + ahead]
    assert waiting == 2 * ahead


def test_a_scored_sample_frees_its_slot_for_the_next_group(tmp_path):
    """Group p0's first sample is scored while its second is held: p1 starts in the freed slot,
    although p0 is not finished (3 slots, nothing scheduled ahead)."""

    def ready(state):
        return "p1" in [str(g) for g in state.groups]

    groups, _ = _scheduled_groups(lambda rid: rid == 0, ready, tmp_path, 3, 0)
    assert groups == ["p0", "p1"]


def test_a_sample_graded_after_its_last_turn_holds_no_slot(tmp_path):
    """One-turn samples whose grading never ends: each sample's slot is released when its turn
    goes to the environment, so with 2 slots and nothing scheduled ahead every group starts, not
    only the first, while none is ever scored."""

    def ready(state):
        return len(state.groups) == 4 and not state.by_request and not state.waiting

    groups, _ = _scheduled_groups(lambda rid: True, ready, tmp_path, 2, 0, pool=_UngradedPool)
    assert groups == ["p0", "p1", "p2", "p3"]


def test_an_epoch_with_groups_still_to_resume_is_not_over(tmp_path):
    """Right after a restart the saved group waits for the rollout thread to rebuild it: the
    last prompt of the epoch is not in the queue nor yet in flight. The trainer's wait must not
    take that for the end of the epoch (it returned [] and the run stopped short)."""
    task = envs.builtin_tasks(1, seed=41, max_ops=1)[0]
    cfg = RLConfig(
        rollout=RolloutConfig(group_size=2, groups_per_step=1),
        agent=AgentConfig(max_turns=4, feedback_detectors=()),
    )
    sampler = ScriptedSampler(lambda prompt, turn: "x", TOKENIZER)
    with ThreadEnvironmentPool(2) as pool:
        coordinator = make_coordinator(
            cfg,
            sampler,
            pool,
            GroupLedger(tmp_path),
            [("p0", task)],
            resume=[GroupState("p0", 0, [])],
        )
        assert coordinator.scheduler.queued == 0 and not coordinator.state.groups
        assert not coordinator.exhausted
        with pytest.raises(TimeoutError):
            coordinator.wait_for_groups(1, timeout_s=0.5)
