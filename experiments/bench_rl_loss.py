r"""RL loss + gradient time against a plain cross-entropy loss + gradient on the tiny model.

Both run the same model, batch shape and parameters (MTP off, so the baseline is pure next-token
CE); the RL variants add router replay, the KL term, importance weights, group advantages, the
length penalty and optionally the distillation teacher pass. Prints a table with the overhead ratio.

  python -m experiments.bench_rl_loss [--batch=8] [--seq_len=128] [--steps=10]
"""

import dataclasses
import time

from absl import app, flags

_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step (groups of 4).")
_SEQ = flags.DEFINE_integer("seq_len", 128, "Tokens per sequence.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per round (5 rounds, after a warm-up).")
_PROMPT = 16


def make_batch(model, batch_size: int, seq_len: int, hinted_rows: int):
    """Random rollouts sampled from `model` (`bench_throughput.rollout_sequences`), groups of 4;
    the first `hinted_rows` carry a hinted teacher context for the distillation term."""
    import numpy as np

    from composer_jax import rl
    from experiments.bench_throughput import rollout_sequences

    sequences = rollout_sequences(model, batch_size, seq_len, _PROMPT)
    hint = np.arange(8) + 1
    for seq in sequences[:hinted_rows]:
        seq.teacher_tokens = np.concatenate([seq.tokens[:_PROMPT], hint, seq.tokens[_PROMPT:]])
        seq.teacher_target_index = np.where(
            np.arange(seq_len) >= _PROMPT, np.arange(seq_len) + len(hint), -1
        )
    rewards = {"task": np.random.default_rng(0).normal(size=batch_size)}
    group_id = np.arange(batch_size) // 4
    return rl.pack_trajectories(sequences, group_id, rewards, seq_len, teacher_seq_len=seq_len + 8)


def time_it(fn, *args, steps: int, repeats: int = 5) -> tuple[float, float]:
    """(compile seconds, milliseconds per call): the best of `repeats` rounds of `steps` calls,
    which filters out time stolen by other processes on a shared machine."""
    import jax

    t0 = time.perf_counter()
    compiled = fn.trace(*args).lower().compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = compiled(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / steps * 1e3)
    return compile_s, best


def main(argv):
    del argv
    import jax
    from flax import nnx

    from composer_jax import config, presets, rl
    from composer_jax.model import init_model
    from composer_jax.train import step as step_lib

    model_cfg = dataclasses.replace(presets.tiny().model, num_mtp_layers=0, replay_min_ratio=0.5)
    model = init_model(model_cfg, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    B, T, steps = _BATCH.value, _SEQ.value, _STEPS.value
    plain = make_batch(model, B, T, hinted_rows=0)
    hinted = make_batch(model, B, T, hinted_rows=max(B // 4, 1))
    ce_batch = {
        "tokens": plain.tokens_BT,
        "positions": plain.positions_BT,
        "segment_ids": plain.segment_ids_BT,
    }
    ref_logp = jax.jit(rl.reference_logprobs)(model, plain)
    ref_logits = jax.jit(lambda m, b: rl.trainer_logits(m, b, replay=False)[0])(model, plain)

    @jax.jit
    def ce_step(params, batch):
        def loss(p):
            return step_lib.pretrain_loss(nnx.merge(graphdef, p, rest), batch, config.TrainConfig())

        return jax.value_and_grad(loss, has_aux=True)(params)

    def rl_step(cfg):
        @jax.jit
        def run(params, batch, ref_logp, ref_logits):
            def loss(p):
                return rl.rl_loss(nnx.merge(graphdef, p, rest), batch, cfg, ref_logp, ref_logits)

            return jax.value_and_grad(loss, has_aux=True)(params)

        return run

    base = rl.RLObjectiveConfig(max_generation_len=T)
    variants = [
        ("RL: k1 in reward, truncated IS, replay", base, plain),
        ("RL: + PPO clip", dataclasses.replace(base, importance_weighting="ppo_clip"), plain),
        (
            "RL: exact KL in loss",
            dataclasses.replace(base, kl_estimator="exact", kl_placement="in_loss"),
            plain,
        ),
        ("RL: + distillation teacher pass", base, hinted),
    ]
    compile_s, ce_ms = time_it(ce_step, params, ce_batch, steps=steps)
    rows = [("plain cross-entropy", compile_s, ce_ms)]
    for name, cfg, batch in variants:
        compile_s, ms = time_it(rl_step(cfg), params, batch, ref_logp, ref_logits, steps=steps)
        rows.append((name, compile_s, ms))
    print(f"\nloss + grad, tiny model, batch {B} x {T}, {jax.devices()[0].platform}")
    print(f"{'variant':<42} {'compile s':>9} {'ms/step':>9} {'vs CE':>7}")
    for name, compile_s, ms in rows:
        print(f"{name:<42} {compile_s:9.2f} {ms:9.2f} {ms / ce_ms:7.2f}")


if __name__ == "__main__":
    app.run(main)
