"""The trainer role: one RL step on a real rollout publishes a delta that rebuilds bitwise, and a
checkpoint resumes the same policy version."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax import agent, config, presets
from composer_jax.actor.trainer import NonFiniteRLLossError, RLTrainer
from composer_jax.data import ByteTokenizer
from composer_jax.envs import builtin_tasks
from composer_jax.infer import InferenceEngine, SamplingParams
from composer_jax.model import init_model
from composer_jax.train.step import split_model
from composer_jax.weight_sync import LocalDirStore, WeightSubscriber

SEQ_LEN = 384  # a tiny task's prompt (<= ~310 bytes) plus one short turn


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _bf16_words(tree):
    return [np.asarray(x.astype(jnp.bfloat16)).view(np.uint16) for x in jax.tree.leaves(tree)]


def test_step_publishes_an_exact_delta_and_resumes(tmp_path):
    cfg = dataclasses.replace(presets.rl_tiny(), workdir=str(tmp_path / "run"))
    model = init_model(cfg.model, 0)
    _, params, buffers = split_model(model)
    store = str(tmp_path / "weights")
    trainer = RLTrainer(cfg, params, buffers, store)
    assert trainer.restored_step is None and trainer.version == 0
    assert trainer.publish().result().kind == "snapshot"

    engine = InferenceEngine(model, num_slots=4, max_len=SEQ_LEN, prefill_buckets=(SEQ_LEN,))
    tasks = builtin_tasks(2, "train", seed=0, max_ops=1)
    sampling = SamplingParams(max_new_tokens=16, seed=1)
    workflow, env = agent.build(
        config.AgentConfig(max_turns=1),
        ByteTokenizer(),
        model.cfg,
        max_len=SEQ_LEN,
        sampling=sampling,
        distill=config.RLObjectiveConfig().distill_coef > 0,
    )
    batch, _ = agent.collect_batch(engine, tasks, 2, workflow, env, seq_len=SEQ_LEN, num_rows=8)
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

    # The whole train state comes back: step, weights, buffers and the optimizer's moments.
    saved = _host(trainer.state)
    trainer.save({"step": trainer.version})
    trainer.close()
    resumed = RLTrainer(cfg, params, buffers, str(tmp_path / "weights-2"))
    assert resumed.restored_step == 1 and resumed.version == 1
    assert len(_host(resumed.state)) == len(saved) > len(after)
    for got, want in zip(_host(resumed.state), saved, strict=True):
        np.testing.assert_array_equal(got, want)

    # A non-finite step raises and leaves the policy as it was (its buffers were donated).
    poisoned = dataclasses.replace(
        batch, rewards_N={"task": np.array([np.nan, 0, 0, 1], np.float32)}
    )
    with pytest.raises(NonFiniteRLLossError):
        resumed.step(poisoned)
    assert resumed.version == 1
    for got, want in zip(_host(resumed.state), saved, strict=True):  # moments included
        np.testing.assert_array_equal(got, want)
    resumed.close()


def _packed_rl_batch(cfg, seed: int = 7):
    """Eight random trajectories (prompt, then policy tokens with sampler log-probs and router
    choices) in two groups, packed into 8 rows of 256."""
    from composer_jax.rl.batch import SegmentKind, Sequence, pack_trajectories

    rng = np.random.default_rng(seed)
    sequences = []
    for i in range(8):
        n = int(rng.integers(40, 120))
        policy = np.arange(n) >= 10
        sequences.append(
            Sequence(
                sample_index=i,
                tokens=rng.integers(3, 259, n).astype(np.int32),
                kinds=np.where(policy, SegmentKind.THINKING, SegmentKind.PROMPT).astype(np.int32),
                policy_mask=policy,
                sampler_logprobs=np.where(policy, -rng.random(n) * 3, 0).astype(np.float32),
                policy_versions=np.zeros(n, np.int32),
                router_indices=np.stack(
                    [rng.permutation(cfg.model.num_experts)[:2] for _ in range(n)]
                )[None].astype(np.int32),
            )
        )
    return pack_trajectories(
        sequences,
        group_id=np.repeat(np.arange(2), 4).astype(np.int32),
        rewards={"task": rng.random(8).astype(np.float32)},
        seq_len=256,
        num_rows=8,
    )


def test_step_on_eight_devices_equals_one_device(tmp_path):
    """The RL step sharded over the simulated 8-device mesh (FSDP + expert parallel) matches
    the same step on one device. Computed in float32: the claim is equality, so only the
    summation order may differ between layouts."""
    from composer_jax.parallel import make_layout

    cfg = presets.rl_tiny()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="float32"))
    model = init_model(cfg.model, 3)
    _, params, buffers = split_model(model)
    batch = _packed_rl_batch(cfg)
    results = []
    for name, devices in (("one", jax.devices()[:1]), ("eight", jax.devices())):
        run = dataclasses.replace(cfg, workdir=str(tmp_path / name))
        layout = make_layout(cfg.mesh, devices)
        trainer = RLTrainer(run, params, buffers, str(tmp_path / f"w-{name}"), layout=layout)
        metrics = trainer.step(batch)
        results.append((metrics, _host(trainer.state.params)))
        trainer.close()
    (m1, p1), (m8, p8) = results
    assert m1["grad_norm"] > 0 and not all(np.array_equal(a, b) for a, b in zip(p1, _host(params)))
    for key in ("loss", "pg_loss", "grad_norm"):
        np.testing.assert_allclose(m8[key], m1[key], rtol=1e-4, err_msg=key)
    assert "expert_drop_rate" not in m8  # a dropless exchange has no drops to report
    # k1 is a mean of differences of log-probs of size up to log(vocab) ~ 5.6: its float32
    # rounding is absolute, about 1e-6 of the log-probs, whatever the KL's own size.
    np.testing.assert_allclose(m8["kl_k1"], m1["kl_k1"], rtol=0, atol=1e-5 * np.log(259))
    lr = cfg.optim.learning_rate
    moved = 0
    for a, b in zip(p8, p1):
        diff = np.abs(a - b)
        assert diff.max() <= 2.5 * lr  # at most a first Adam step of opposite sign
        moved += int((diff > lr / 2).sum())
    assert moved <= 0.01 * sum(a.size for a in p1)  # only near-zero gradients flip


def test_a_bounded_expert_exchange_reports_its_drops_in_the_rl_step(tmp_path):
    """With the expert exchange bounded (8 devices, capacity 0.5) the RL step still trains and
    reports the share of routed slots it dropped."""
    from composer_jax.parallel import make_layout

    cfg = presets.rl_tiny()
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, ep_capacity=0.5))
    _, params, buffers = split_model(init_model(cfg.model, 3))
    trainer = RLTrainer(
        cfg, params, buffers, str(tmp_path / "w"), layout=make_layout(cfg.mesh, jax.devices())
    )
    metrics = trainer.step(_packed_rl_batch(cfg))
    trainer.close()
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert 0 < metrics["expert_drop_rate"] < 1


def test_qk_clip_in_the_rl_step_shrinks_only_the_query_and_key_projections(tmp_path):
    """With `optim.qk_clip_threshold` below the policy's logits, the RL step reports the heads it
    rescaled, and its weights differ from the same step without QK-clip only in the query and
    key projections, each shrunk (factors in (0, 1])."""
    cfg = presets.rl_tiny()
    _, params, buffers = split_model(init_model(cfg.model, 3))
    batch = _packed_rl_batch(cfg)
    results = {}
    for threshold in (0.0, 0.5):
        run = dataclasses.replace(
            cfg,
            workdir=str(tmp_path / str(threshold)),
            optim=dataclasses.replace(cfg.optim, qk_clip_threshold=threshold),
        )
        trainer = RLTrainer(run, params, buffers, str(tmp_path / f"w-{threshold}"))
        metrics = trainer.step(batch)
        results[threshold] = metrics, jax.tree_util.tree_leaves_with_path(trainer.state.params)
        trainer.close()
    (plain_metrics, plain), (metrics, clipped) = results[0.0], results[0.5]
    assert "qk_clipped_heads" not in plain_metrics  # logged only with QK-clip on
    assert plain_metrics["attention_max_logit"] == metrics["attention_max_logit"]
    assert metrics["qk_clipped_heads"] > 0 and metrics["attention_max_logit"] > 0.5
    np.testing.assert_allclose(metrics["loss"], plain_metrics["loss"], rtol=1e-6)
    shrunk = 0
    for (path, got), (_, want) in zip(clipped, plain):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        if any(getattr(k, "key", None) in ("q_b_proj", "kv_b_proj") for k in path):
            assert (np.abs(got) <= np.abs(want) * (1 + 1e-6)).all()
            shrunk += int((np.abs(got) < np.abs(want) * (1 - 1e-3)).sum())
        else:
            np.testing.assert_array_equal(got, want)
    assert shrunk > 0


def test_the_exact_kl_trains_against_the_reference_logits(tmp_path):
    """`kl_estimator="exact"` (full-vocabulary KL to the warm start): the trainer's reference
    pass gives the logits it needs, and each step's KL term is the one `rl_loss` gives with the
    warm start's logits (not 0 at the first step: the policy's routes are the batch's). At the
    sampler's temperature 0.5 both are the tempered distributions': the trainer's policy is what
    the sampler draws from."""
    from flax import nnx

    from composer_jax.actor.trainer import rl_objective
    from composer_jax.rl import reference_logits, rl_loss

    cfg = presets.rl_tiny()
    objective = dataclasses.replace(
        cfg.rl.objective, kl_estimator="exact", kl_placement="in_loss", kl_coef=0.5
    )
    cfg = dataclasses.replace(
        cfg,
        workdir=str(tmp_path / "run"),
        model=dataclasses.replace(cfg.model, dtype="float32"),  # a KL this small, compared
        rl=dataclasses.replace(
            cfg.rl,
            objective=objective,
            rollout=dataclasses.replace(cfg.rl.rollout, temperature=0.5),
        ),
    )
    graphdef, params, buffers = split_model(init_model(cfg.model, 3))
    batch = _packed_rl_batch(cfg)
    reference = reference_logits(nnx.merge(graphdef, params, buffers), batch, 0.5)
    trainer = RLTrainer(cfg, params, buffers, str(tmp_path / "weights"))
    for _ in range(2):  # the warm start itself (under replayed routes), then a moved policy
        policy = nnx.merge(graphdef, trainer.state.params, buffers)
        _, want = rl_loss(
            policy, batch, rl_objective(cfg.rl), ref_logits_BTV=reference, temperature=0.5
        )
        got = trainer.step(batch)
        assert float(want["kl_loss"]) > 1e-6
        np.testing.assert_allclose(got["kl_loss"], float(want["kl_loss"]), rtol=1e-4)
        np.testing.assert_allclose(got["kl_k1"], float(want["kl_k1"]), rtol=1e-4)
    trainer.close()


def test_the_loss_normaliser_is_the_runs_not_the_batchs():
    """The epoch's last step may carry fewer groups; its tokens weigh the same as every
    other step's: the normaliser is groups_per_step * group_size * max_generation_len."""
    from composer_jax.actor.trainer import rl_objective
    from composer_jax.rl import policy_objective
    from tests.rl.toy import one_step_batch

    rl = dataclasses.replace(
        presets.rl_tiny().rl,
        objective=dataclasses.replace(
            presets.rl_tiny().rl.objective, kl_coef=0.0, length_penalty_coef=0.0
        ),
    )
    objective = rl_objective(rl)
    assert (
        objective.loss_normalizer
        == rl.rollout.groups_per_step * rl.rollout.group_size * rl.objective.max_generation_len
    )
    assert (
        rl_objective(
            dataclasses.replace(
                rl, objective=dataclasses.replace(rl.objective, loss_normalizer=7.0)
            )
        ).loss_normalizer
        == 7.0
    )
    rng = np.random.default_rng()
    choices, reward_v = rng.integers(0, 4, 8), rng.random(4)  # reward of each token value
    logits = rng.normal(size=(8, 2, 4)).astype(np.float32)
    full = one_step_batch(choices, np.log(np.full(4, 0.25)), reward_v, group_size=4)
    half = one_step_batch(choices[:4], np.log(np.full(4, 0.25)), reward_v, group_size=4)
    _, both = policy_objective(logits, full, objective)
    _, first = policy_objective(logits[:4], half, objective)
    _, second = policy_objective(
        logits[4:],
        one_step_batch(choices[4:], np.log(np.full(4, 0.25)), reward_v, group_size=4),
        objective,
    )
    np.testing.assert_allclose(
        float(first["pg_loss"]) + float(second["pg_loss"]), float(both["pg_loss"]), rtol=1e-5
    )
