"""The trainer role: one RL step on a real rollout publishes a delta that rebuilds bitwise, and a
checkpoint resumes the same policy version."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import config
from composer_jax.data import ByteTokenizer
from composer_jax.envs import builtin_tasks
from composer_jax.infer import InferenceEngine, SamplingParams
from composer_jax.model import init_model
from composer_jax.rl.rollout import collect_batch
from composer_jax.rl.trainer import NonFiniteRLLossError, RLTrainer
from composer_jax.rl.weight_sync import LocalDirStore, WeightSubscriber
from composer_jax.train.step import split_model

SEQ_LEN = 384  # a tiny task's prompt (<= ~310 bytes) plus one short turn


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _bf16_words(tree):
    return [np.asarray(x.astype(jnp.bfloat16)).view(np.uint16) for x in jax.tree.leaves(tree)]


def test_step_publishes_an_exact_delta_and_resumes(tmp_path):
    cfg = dataclasses.replace(config.rl_tiny(), workdir=str(tmp_path / "run"))
    model = init_model(cfg.model, 0)
    _, params, buffers = split_model(model)
    store = str(tmp_path / "weights")
    trainer = RLTrainer(cfg, params, buffers, store)
    assert trainer.restored_step is None and trainer.version == 0
    assert trainer.publish().result().kind == "snapshot"

    engine = InferenceEngine(model, num_slots=4, max_len=SEQ_LEN, prefill_buckets=(SEQ_LEN,))
    tasks = builtin_tasks(2, "train", seed=0, max_ops=cfg.data.task_max_ops)
    sampling = SamplingParams(max_new_tokens=16, seed=1)
    batch, _ = collect_batch(
        engine, tasks, 2, sampling, 1, ByteTokenizer(), seq_len=SEQ_LEN, num_rows=8
    )
    # The untrained policy scores 0 everywhere and fills every turn (no advantage, no gradient):
    # one sample per group is rewarded instead.
    batch = dataclasses.replace(batch, rewards_N={"task": np.array([1, 0, 0, 1], np.float32)})
    before = _host(trainer.state.params)

    metrics = trainer.step(batch)
    info = trainer.last_publish.result()
    assert trainer.version == 1
    assert (info.version, info.kind, info.parent) == (1, "delta", 0)
    assert metrics["grad_norm"] > 0
    after = _host(trainer.state.params)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))

    subscriber = WeightSubscriber(LocalDirStore(store))
    assert subscriber.update() == 1
    rebuilt = subscriber.tree_like(trainer.state.params)
    for got, want in zip(_bf16_words(rebuilt), _bf16_words(trainer.state.params)):
        np.testing.assert_array_equal(got, want)

    trainer.save({"step": trainer.version})
    trainer.close()
    resumed = RLTrainer(cfg, params, buffers, str(tmp_path / "weights-2"))
    assert resumed.restored_step == 1 and resumed.version == 1
    for got, want in zip(_host(resumed.state.params), after):
        np.testing.assert_array_equal(got, want)

    # A non-finite step raises and leaves the policy as it was (its buffers were donated).
    poisoned = dataclasses.replace(
        batch, rewards_N={"task": np.array([np.nan, 0, 0, 1], np.float32)}
    )
    with pytest.raises(NonFiniteRLLossError):
        resumed.step(poisoned)
    assert resumed.version == 1
    for got, want in zip(_host(resumed.state.params), after):
        np.testing.assert_array_equal(got, want)
    resumed.close()
