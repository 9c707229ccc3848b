r"""Compressed delta size and publish / rebuild time of the weight sync after AdamW steps.

For each preset: fp32 master weights from `init_model`, AdamW (lr 1e-4, decay 0.1 on matrices) on
random gradients; after each step the weights are published (bf16) as XOR and as arithmetic
deltas. Prints, for the first step (fresh moments: every weight moves by exactly lr, the worst
case) and for the last one (moments warmed up), the share of bf16 words that changed and the
compressed delta as a % of the full bf16 weights, the time `publish_async` takes to return (what
the trainer waits), the background publish time, and incremental-update and from-scratch rebuild
times. Every rebuild is checked bitwise against the trainer's bf16 cast.

  python experiments/bench_weight_sync.py [--presets=tiny,small] [--steps=5] [--level=3]
"""

import tempfile
import time

from absl import app, flags

_PRESETS = flags.DEFINE_list("presets", ["tiny", "small"], "Presets from composer_jax.config.")
_STEPS = flags.DEFINE_integer("steps", 5, "AdamW steps; the first and the last are reported.")
_LEVEL = flags.DEFINE_integer("level", 3, "zstd compression level.")
_LR = flags.DEFINE_float("lr", 1e-4, "AdamW learning rate.")


def _bench_preset(name: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from composer_jax import config
    from composer_jax.model import init_model
    from composer_jax.rl.weight_sync import LocalDirStore, WeightPublisher, WeightSubscriber

    params = nnx.to_pure_dict(nnx.state(init_model(getattr(config, name)().model), nnx.Param))
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

    def words(tree):
        return np.concatenate(
            [
                np.asarray(x.astype(jnp.bfloat16)).view(np.uint16).ravel()
                for x in jax.tree.leaves(tree)
            ]
        )

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
        current, before = params, words(params)
        for s in range(1, _STEPS.value + 1):
            current, opt_state = step(current, opt_state, jax.random.key(s))
            after = words(current)
            changed = np.mean(after != before)
            for mode, (store, pub, sub) in mode_state.items():
                t = time.perf_counter()
                future = pub.publish_async(current, s)
                enqueue_ms = 1e3 * (time.perf_counter() - t)
                info = future.result()
                t = time.perf_counter()
                sub.update()
                update_s = time.perf_counter() - t
                assert np.array_equal(words(sub.tree_like(current)), after), "rebuild not bitwise"
                if s in (1, _STEPS.value):
                    print(
                        f"{s:>4} {100 * changed:>7.1f}% {mode:>5} {100 * info.ratio:>7.2f}% "
                        f"{enqueue_ms:>10.1f} {info.seconds:>9.2f} {update_s:>8.2f}"
                    )
            before = after
        for mode, (store, pub, _) in mode_state.items():
            pub.close()
            t = time.perf_counter()
            fresh = WeightSubscriber(store)
            fresh.update()
            print(
                f"{mode}: rebuild from scratch (snapshot + {_STEPS.value} deltas) "
                f"{time.perf_counter() - t:.2f}s, bitwise equal: "
                f"{np.array_equal(words(fresh.tree_like(current)), before)}"
            )


def main(argv):
    del argv
    for name in _PRESETS.value:
        _bench_preset(name)


if __name__ == "__main__":
    app.run(main)
