r"""Compressed delta size and publish / rebuild time of the weight sync after AdamW steps.

For each preset: fp32 master weights from `init_model`, AdamW (lr 1e-4, decay 0.1 on matrices) on
random gradients; after each step the weights are published (bf16) as XOR and as arithmetic
deltas. Prints, for the first step (fresh moments: every weight moves by exactly lr, the worst
case) and for the last one (moments warmed up), the share of bf16 words that changed and the
compressed delta as a % of the full bf16 weights, the time `publish_async` takes to return (what
the trainer waits), the background publish time, and incremental-update and from-scratch rebuild
times, then the codec table below for those two steps. Every rebuild is checked bitwise against
the trainer's bf16 cast.

With --rl_step, the acceptance check after one *real* RL step instead: for each RL preset a fresh
`RLTrainer` publishes version 0, the model itself plays a few built-in tasks (InferenceEngine +
`collect_batch`, one turn each), one trainer step on that batch publishes version 1, and the
delta (the preset's mode, and the other one through a second publisher) is printed as a % of the
full bf16 weights; a `WeightSubscriber` rebuild must equal the trainer's bf16 params bitwise
(exit 1 if not). A second table codes the same step's words with the format-1 codec (the
baseline: 4-bit codes in tensor order) and the current one, each mode: size, ratio to the
baseline, encode / decode MB/s of bf16 weights (thread CPU time: less disturbed than wall time
by other processes on a shared machine, not immune to them), and a bitwise round trip.

  python experiments/bench_weight_sync.py [--presets=tiny,small] [--steps=5] [--level=3]
  python experiments/bench_weight_sync.py --rl_step [--rl_presets=rl_tiny,rl_small]
"""

import dataclasses
import sys
import tempfile
import time

from absl import app, flags

_PRESETS = flags.DEFINE_list("presets", ["tiny", "small"], "Presets from composer_jax.presets.")
_STEPS = flags.DEFINE_integer("steps", 5, "AdamW steps; the first and the last are reported.")
_LEVEL = flags.DEFINE_integer("level", 3, "zstd compression level.")
_LR = flags.DEFINE_float("lr", 1e-4, "AdamW learning rate.")
_RL_STEP = flags.DEFINE_bool("rl_step", False, "One real RL step per RL preset instead.")
_RL_PRESETS = flags.DEFINE_list("rl_presets", ["rl_tiny", "rl_small"], "RL presets (--rl_step).")
_TASKS = flags.DEFINE_integer("tasks", 2, "--rl_step: built-in train tasks, one group each.")
_GROUP = flags.DEFINE_integer("group", 2, "--rl_step: samples per task.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 32, "--rl_step: generated tokens per sample.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 512, "--rl_step: engine context and packed row length.")


def _bench_preset(name: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from composer_jax import presets
    from composer_jax.model import init_model
    from composer_jax.weight_sync import LocalDirStore, WeightPublisher, WeightSubscriber

    params = nnx.to_pure_dict(nnx.state(init_model(getattr(presets, name)().model), nnx.Param))
    params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    n = sum(x.size for x in jax.tree.leaves(params))
    opt = optax.adamw(_LR.value, weight_decay=0.1, mask=jax.tree.map(lambda x: x.ndim >= 2, params))
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, key):
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(key, len(leaves))
        grads = treedef.unflatten([jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    print(f"\n{name}: {n / 1e6:.1f}M parameters, full bf16 weights {2 * n / 2**20:.1f} MiB")
    print(
        f"{'step':>4} {'changed':>8} {'mode':>5} {'delta %':>8} {'enqueue ms':>10} "
        f"{'publish s':>9} {'update s':>8}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        mode_state = {}
        for mode in ("xor", "add"):
            store = LocalDirStore(f"{tmp}/{mode}")
            pub = WeightPublisher(
                store, delta=mode, snapshot_every=_STEPS.value + 1, level=_LEVEL.value
            )
            sub = WeightSubscriber(store)
            info = pub.publish(params, 0)
            sub.update()
            mode_state[mode] = (store, pub, sub)
        print(f"   0 snapshot: {100 * info.ratio:.1f}% of the bf16 weights after zstd")
        current, before_leaves = params, _bf16_leaves(params)
        before, codec_rows = np.concatenate(before_leaves), []
        for s in range(1, _STEPS.value + 1):
            current, opt_state = step(current, opt_state, jax.random.key(s))
            after_leaves = _bf16_leaves(current)
            after = np.concatenate(after_leaves)
            changed = np.mean(after != before)
            for mode, (_, pub, sub) in mode_state.items():
                row = _publish_and_update(pub, sub, current, s, after)
                if s in (1, _STEPS.value):
                    print(f"{s:>4} {100 * changed:>7.1f}% {mode:>5} {row}")
            if s in (1, _STEPS.value):
                rows, exact = _codec_rows(before_leaves, after_leaves)
                assert exact, "a codec round trip is not bitwise"
                codec_rows += [f"{s:>4} {row}" for row in rows]
            before, before_leaves = after, after_leaves
        print(f"{'step':>4} {_CODEC_HEADER}")
        print("\n".join(codec_rows))
        for mode, (store, pub, _) in mode_state.items():
            pub.close()
            t = time.perf_counter()
            fresh = WeightSubscriber(store)
            fresh.update()
            equal = np.array_equal(_bf16_words(fresh.tree_like(current)), before)
            print(
                f"{mode}: rebuild from scratch (snapshot + {_STEPS.value} deltas) "
                f"{time.perf_counter() - t:.2f}s, bitwise equal: {equal}"
            )


def _publish_and_update(pub, sub, params, version: int, words) -> str:
    """Publishes `params` as `version` and brings the subscriber up to it, checked bitwise
    against the bf16 `words`; the row's timing columns (delta %, enqueue ms, publish s, update s)."""
    import numpy as np

    t = time.perf_counter()
    future = pub.publish_async(params, version)
    enqueue_ms = 1e3 * (time.perf_counter() - t)
    info = future.result()
    t = time.perf_counter()
    sub.update()
    update_s = time.perf_counter() - t
    assert np.array_equal(_bf16_words(sub.tree_like(params)), words), "rebuild not bitwise"
    return f"{100 * info.ratio:>7.2f}% {enqueue_ms:>10.1f} {info.seconds:>9.2f} {update_s:>8.2f}"


def _printable_share(batch):
    """Per sample, the share of its generated bytes that are printable ASCII."""
    import numpy as np

    mask = np.asarray(batch.policy_mask_BT)
    index = np.asarray(batch.sample_index_BT)[mask]
    tokens = np.asarray(batch.tokens_BT)[mask]
    n = batch.num_samples
    printable = np.bincount(index, (tokens >= 32) & (tokens < 127), n)
    return (printable / np.maximum(np.bincount(index, minlength=n), 1)).astype(np.float32)


def _with_signal(batch):
    """The batch, plus a stand-in reward component when nothing in it separates a group's samples.

    An untrained model scores 0 on every task and fills every turn to the token limit, so task
    reward and length penalty tie within each group (and the KL term is 0: the policy is still
    the reference): the advantages, hence the policy gradient, vanish and only weight decay would
    move the weights. The stand-in (share of printable
    generated bytes) is a real function of each rollout, and the printout names it.
    """
    import numpy as np

    groups = np.asarray(batch.group_id_N)
    task = np.asarray(batch.rewards_N["task"])
    mask = np.asarray(batch.policy_mask_BT)
    lengths = np.bincount(np.asarray(batch.sample_index_BT)[mask], minlength=batch.num_samples)
    valid = groups[groups >= 0]
    if any(np.ptp(task[groups == g]) + np.ptp(lengths[groups == g]) > 0 for g in set(valid)):
        return batch, "task - length penalty - KL"
    rewards = dict(batch.rewards_N, printable=_printable_share(batch))
    return dataclasses.replace(batch, rewards_N=rewards), "tied in every group: + printable share"


def _bf16_leaves(tree):
    import jax
    import jax.numpy as jnp
    import numpy as np

    return [
        np.asarray(x.astype(jnp.bfloat16)).view(np.uint16).ravel() for x in jax.tree.leaves(tree)
    ]


def _bf16_words(tree):
    import numpy as np

    return np.concatenate(_bf16_leaves(tree))


def _format1_pack(stored):
    """The format-1 delta payload (the baseline): 4-bit codes in tensor order, 15 = escape."""
    import numpy as np

    from composer_jax.weight_sync import codec

    codes = np.minimum(stored, 15).astype(np.uint8)
    codes = np.append(codes, np.zeros(codes.size % 2, np.uint8))
    return (codes[0::2] | (codes[1::2] << 4)).tobytes() + codec.to_planes(stored[stored >= 15])


def _format1_unpack(data, base):
    import numpy as np

    from composer_jax.weight_sync import codec

    nbytes = (base.size + 1) // 2
    packed = np.frombuffer(data, np.uint8, count=nbytes)
    codes = np.stack([packed & 15, packed >> 4], 1).ravel()[: base.size].astype(np.uint16)
    escaped = codes == 15
    codes[escaped] = codec.from_planes(data[nbytes:], int(escaped.sum()))
    return codes


_CODEC_HEADER = (
    f"{'mode':>4} {'codec':>9} {'delta %':>8} {'vs fmt 1':>8} {'enc MB/s':>9} {'dec MB/s':>9} "
    f"{'bitwise':>7}"
)


def _codec_rows(before, after):
    """Format 1 vs the current codec on the same (base, new) leaves per mode: (rows, all exact)."""
    import numpy as np
    import zstandard

    from composer_jax.weight_sync import codec

    compressor = zstandard.ZstdCompressor(level=_LEVEL.value, write_checksum=True)  # as published
    decompressor = zstandard.ZstdDecompressor()
    codecs = {"format 1": (_format1_pack, _format1_unpack), "current": (None, None)}
    raw = 2 * sum(b.size for b in before)
    rows, all_exact = [], True
    for mode in ("add", "xor"):
        baseline = None
        for name, (pack, unpack) in codecs.items():
            size, encode_s, decode_s, exact = 0, 0.0, 0.0, True
            for base, new in zip(before, after):
                t = time.thread_time()
                stored = codec.encode_words(new, base, mode)
                payload = pack(stored) if pack else codec.pack_delta(stored, base)
                blob = compressor.compress(payload)
                encode_s += time.thread_time() - t
                t = time.thread_time()
                data = decompressor.decompress(blob)
                stored = unpack(data, base) if unpack else codec.unpack_delta(data, base)
                rebuilt = codec.decode_words(stored, base, mode)
                decode_s += time.thread_time() - t
                size += len(blob)
                exact &= np.array_equal(rebuilt, new)
            baseline = baseline or size
            all_exact &= exact
            rows.append(
                f"{mode:>4} {name:>9} {100 * size / raw:>7.2f}% {size / baseline:>8.3f} "
                f"{raw / 2**20 / max(encode_s, 1e-9):>9.0f} {raw / 2**20 / max(decode_s, 1e-9):>9.0f}"
                f" {'ok' if exact else 'FAIL':>7}"
            )
    return rows, all_exact


def _play(cfg, model, data_parallel: int):
    """The untrained model plays --tasks built-in train tasks, --group samples each, one turn:
    (the packed batch, rollout stats)."""
    from composer_jax import agent, envs
    from composer_jax.infer import InferenceEngine, SamplingParams
    from composer_jax.train.runs import resolve_tokenizer

    samples = _TASKS.value * _GROUP.value
    engine = InferenceEngine(
        model, num_slots=samples, max_len=_SEQ_LEN.value, prefill_buckets=(_SEQ_LEN.value,)
    )
    tasks = envs.load_task_source(cfg.data.tasks).take(_TASKS.value, "train", cfg.seed)
    sampling = SamplingParams(
        temperature=cfg.rl.rollout.temperature,
        top_p=cfg.rl.rollout.top_p,
        max_new_tokens=_NEW_TOKENS.value,
    )
    workflow, env = agent.build(
        dataclasses.replace(cfg.rl.agent, max_turns=1),
        resolve_tokenizer(cfg),
        cfg.model,
        max_len=_SEQ_LEN.value,
        sampling=sampling,
        distill=cfg.rl.objective.distill_coef > 0,
    )
    return agent.collect_batch(
        engine,
        tasks,
        _GROUP.value,
        workflow,
        env,
        seq_len=_SEQ_LEN.value,
        num_rows=-(-samples // data_parallel) * data_parallel,  # a prompt fills most of a row
    )


def _print_rebuilds(tmp: str, modes, infos, trainer, after, changed: float) -> bool:
    """A fresh subscriber per mode rebuilds version 1: one row each; whether every rebuild is
    bitwise the trainer's bf16 params and came from a delta."""
    import numpy as np

    from composer_jax.weight_sync import WeightSubscriber, open_store

    print(
        f"{'mode':>4} {'ver':>3} {'kind':>5} {'changed':>8} {'delta KiB':>9} {'delta %':>8} "
        f"{'publish s':>9} {'rebuild s':>9} {'bitwise':>7}"
    )
    ok = True
    for mode, info in zip(modes, infos):
        t = time.perf_counter()
        sub = WeightSubscriber(open_store(f"{tmp}/{mode}"))
        version = sub.update()
        rebuild_s = time.perf_counter() - t
        rebuilt = _bf16_words(sub.tree_like(trainer.state.params))
        equal = version == trainer.version == 1 and np.array_equal(rebuilt, after)
        ok &= equal and info.kind == "delta"
        print(
            f"{mode:>4} {version:>3} {info.kind:>5} {100 * changed:>7.2f}% "
            f"{info.compressed_bytes / 2**10:>9.1f} {100 * info.ratio:>7.2f}% "
            f"{info.seconds:>9.2f} {rebuild_s:>9.2f} {'ok' if equal else 'FAIL':>7}"
        )
    return ok


def _rl_step_preset(name: str) -> bool:
    """One real RL step on `name`; prints its weight-sync rows, returns whether rebuilds match."""
    import numpy as np

    from composer_jax import presets
    from composer_jax.actor.trainer import RLTrainer
    from composer_jax.model import init_model
    from composer_jax.train.step import split_model
    from composer_jax.weight_sync import WeightPublisher, open_store

    with tempfile.TemporaryDirectory() as tmp:
        cfg = dataclasses.replace(getattr(presets, name)(), workdir=f"{tmp}/run")
        # The trainer publishes in the preset's mode; a second publisher writes the other one.
        modes = (cfg.rl.weight_delta, *(m for m in ("xor", "add") if m != cfg.rl.weight_delta))
        t = time.perf_counter()
        model = init_model(cfg.model, cfg.seed)
        _, params, buffers = split_model(model)
        trainer = RLTrainer(cfg, params, buffers, f"{tmp}/{modes[0]}")
        other = WeightPublisher(open_store(f"{tmp}/{modes[1]}"), delta=modes[1], level=_LEVEL.value)
        trainer.publish().result()
        other.publish(trainer.state.params, trainer.version)
        before = _bf16_leaves(trainer.state.params)
        setup_s = time.perf_counter() - t

        t = time.perf_counter()
        batch, stats = _play(cfg, model, trainer.data_parallel)
        batch, reward = _with_signal(batch)
        rollout_s = time.perf_counter() - t

        t = time.perf_counter()
        metrics = trainer.step(batch)
        infos = [trainer.last_publish.result()]
        step_s = time.perf_counter() - t
        infos.append(other.publish(trainer.state.params, trainer.version))
        after_leaves = _bf16_leaves(trainer.state.params)
        after = np.concatenate(after_leaves)
        changed = np.mean(after != np.concatenate(before))
        print(
            f"\n{name}: lr {metrics['lr']:.0e}, {after.size / 1e6:.1f}M params, full bf16 weights "
            f"{2 * after.size / 2**20:.1f} MiB; reward: {reward} (task reward mean "
            f"{stats['reward'].mean():.2f}), |advantage| {metrics['advantage_abs_mean']:.3g}, "
            f"grad norm {metrics['grad_norm']:.3g}; set-up {setup_s:.1f}s, "
            f"rollout {rollout_s:.1f}s, step + publish {step_s:.1f}s"
        )
        ok = _print_rebuilds(tmp, modes, infos, trainer, after, changed)
        print(_CODEC_HEADER)
        rows, exact = _codec_rows(before, after_leaves)
        print("\n".join(rows))
        ok &= exact
        other.close()
        trainer.close()
    return ok


def main(argv):
    del argv
    if not _RL_STEP.value:
        for name in _PRESETS.value:
            _bench_preset(name)
        return
    ok = True
    for name in _RL_PRESETS.value:
        ok &= _rl_step_preset(name)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    app.run(main)
