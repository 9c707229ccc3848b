"""The scheduler reopened over a ledger an earlier start left: every prompt is trained once, what
was lost (stale, damaged) is redone once, what was final (uninformative) stays done, and a
hard prompt's variant, which lived only in the earlier start's memory, never breaks the run;
and a group none of whose samples generated a token is skipped, not fatal."""

import os

import numpy as np

from composer_jax import envs
from composer_jax.actor.env_workers import EnvironmentPool, EnvWorkerError, failed_future
from composer_jax.actor.ledger import DamagedGroup, Group, GroupLedger
from composer_jax.actor.scheduler import Scheduler
from composer_jax.config import AgentConfig, ModelConfig, RLConfig, RolloutConfig
from tests.actor.scripted import BYTES, ScriptedSampler, make_coordinator

TASKS = envs.builtin_tasks(3, seed=1, max_ops=1)
PROMPTS = [(f"p{i}", task) for i, task in enumerate(TASKS)]


def _group(group_id: str, version: int = 0) -> Group:
    return Group(group_id, group_id, np.array([version]), np.zeros(2), np.array([1.0, 0.0]))


def _queue(scheduler: Scheduler) -> list[str]:
    order = []
    while (group := scheduler.next_group()) is not None:
        order.append(str(group))
    return order


def test_a_reopened_epoch_redoes_stale_groups_but_not_uninformative_ones(tmp_path):
    ledger = GroupLedger(str(tmp_path))
    for group_id in ("p0", "p1"):
        ledger.add(_group(group_id))
    ledger.drop(["p0"], 0, "uninformative")  # final: the run never redoes it
    ledger.drop(["p1"], 5, "stale")  # lost: its prompt is sampled again
    scheduler = Scheduler(RLConfig(), PROMPTS, GroupLedger(str(tmp_path)))
    assert _queue(scheduler) == ["p2", "p1-r1"]


def test_a_damaged_group_is_redone_once_across_a_restart(tmp_path):
    ledger = GroupLedger(str(tmp_path))
    for group_id in ("p0", "p1"):
        ledger.add(_group(group_id))
    for group_id in ("p0", "p1"):  # both damaged on disk; only p0's retry got trained
        path = os.path.join(str(tmp_path), "groups", f"{group_id}.npz")
        data = bytearray(open(path, "rb").read())
        data[len(data) // 3] ^= 0xFF
        open(path, "wb").write(data)
        try:
            ledger.load(group_id)
        except DamagedGroup:
            pass
    ledger.add(_group("p0-r1"))
    ledger.mark_trained(["p0-r1"], 1)
    scheduler = Scheduler(RLConfig(), PROMPTS, GroupLedger(str(tmp_path)))
    assert _queue(scheduler) == ["p2", "p1-r1"]


def test_an_earlier_starts_variants_are_neither_redone_nor_renumbered(tmp_path):
    ledger = GroupLedger(str(tmp_path))
    for group_id in ("p0", "p0v1", "p1v2"):
        ledger.add(_group(group_id))
    cfg = RLConfig(rollout=RolloutConfig(hard_prompt_fraction=0.99))
    scheduler = Scheduler(cfg, PROMPTS[:2], GroupLedger(str(tmp_path)), variant=lambda t, s: t)
    scheduler.redispatch(["p0v1"])  # gone stale after the restart: its task is gone too
    assert scheduler.queued == 1  # p1 alone
    first = scheduler.next_group()
    assert str(first) == "p1"
    scheduler.finished(first, 3, 10)
    variant = scheduler.next_group()  # the hardest prompt again, as a fresh variant
    assert str(variant) == "p1v3" and str(variant) not in ledger
    scheduler.task(variant)
    scheduler.finished(variant, 3, 10)  # a variant is not revisited itself


class _PoolThatNeverStarts(EnvironmentPool):
    def __init__(self):
        super().__init__(10.0)

    def start(self, episode_id, task, config=None, snapshot=None):
        return failed_future(EnvWorkerError("the environment did not start"))

    def step(self, episode_id, output):
        return failed_future(EnvWorkerError("unreachable"))

    def snapshot(self, episode_id):
        return failed_future(EnvWorkerError("unreachable"))

    def close(self, episode_id):
        pass

    def shutdown(self):
        pass


def test_a_group_whose_environments_never_start_is_skipped(tmp_path):
    model = ModelConfig()
    sampler = ScriptedSampler(
        lambda prompt, turn: "hi", BYTES, moe_layers=model.num_moe_layers,
        k=model.num_experts_per_tok,
    )  # fmt: skip
    cfg = RLConfig(
        rollout=RolloutConfig(group_size=2, groups_per_step=1),
        agent=AgentConfig(max_turns=4, feedback_detectors=()),
    )
    ledger = GroupLedger(str(tmp_path))
    coordinator = make_coordinator(cfg, sampler, _PoolThatNeverStarts(), ledger, PROMPTS[:1])
    coordinator.start()
    try:
        assert coordinator.wait_for_groups(1, timeout_s=60) == []  # the epoch ends, untrained
    finally:
        coordinator.stop()  # re-raises a failure of the rollout thread
    assert list(ledger) == [] and coordinator.counters.groups_without_tokens == 1


def test_a_retry_dropped_as_uninformative_closes_its_prompt_across_a_restart(tmp_path):
    """p0 went stale and its retry carried no signal: the run had finished with p0, and a
    restart does not give it a third group."""
    ledger = GroupLedger(str(tmp_path))
    ledger.add(_group("p0"))
    ledger.drop(["p0"], 5, "stale")
    ledger.add(_group("p0-r1"))
    ledger.drop(["p0-r1"], 5, "uninformative")
    scheduler = Scheduler(RLConfig(), PROMPTS, GroupLedger(str(tmp_path)))
    assert _queue(scheduler) == ["p1", "p2"]


def test_a_trained_group_damaged_on_disk_is_not_trained_again(tmp_path):
    """The ledger's record says p0 was trained; its file broke afterwards. A restart sets the
    file aside but does not sample p0 again."""
    ledger = GroupLedger(str(tmp_path))
    ledger.add(_group("p0"))
    ledger.mark_trained(["p0"], 1)
    path = os.path.join(str(tmp_path), "groups", "p0.npz")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    reopened = GroupLedger(str(tmp_path))
    assert reopened.corrupt == ["p0"] and reopened.trained_step("p0") == 1
    assert _queue(Scheduler(RLConfig(), PROMPTS, reopened)) == ["p1", "p2"]


def test_an_uninformative_group_damaged_on_disk_is_not_redone(tmp_path):
    """Dropped as uninformative, the prompt was played to its end; its file breaking later
    does not reopen it."""
    ledger = GroupLedger(str(tmp_path))
    ledger.add(_group("p0"))
    ledger.drop(["p0"], 0, "uninformative")
    path = os.path.join(str(tmp_path), "groups", "p0.npz")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    reopened = GroupLedger(str(tmp_path))
    assert reopened.corrupt == ["p0"]
    assert _queue(Scheduler(RLConfig(), PROMPTS, reopened)) == ["p1", "p2"]
