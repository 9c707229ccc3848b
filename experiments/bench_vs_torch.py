r"""This project against Hugging Face transformers on one random DeepSeek-V3 checkpoint (the `golden`
extra: run it in a venv with transformers and torch).

One random model (MLA with q and kv LoRA, 16 routed experts top-4, a shared expert, a dense first
layer, no MTP) is exported once in float32 and loaded by both sides. First the logits of one batch
are checked equal (within 1e-4); then, in float32 on this CPU, medians over `--repeats`:
  train step   forward + backward + AdamW on the same batch (transformers: model(labels=...)
               .loss.backward(), torch.optim.AdamW; here: the pretraining step, MTP off)
  decode       greedy, cached, `--prompts` prompts of 16 tokens, `--new_tokens` each
The peer runs each experts implementation transformers offers with sdpa attention; the fastest is
kept and named. Ratios are ours / theirs in tokens per second (above 1: faster here).

  PYTHONPATH=. /tmp/golden/bin/python experiments/bench_vs_torch.py [--repeats=5]
"""

import dataclasses
import statistics
import tempfile
import time

from absl import app, flags

_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repeats (after two warm-ups).")
_BATCH = flags.DEFINE_integer("batch", 4, "Train-step batch (rows).")
_SEQ = flags.DEFINE_integer("seq_len", 256, "Train-step row length.")
_PROMPTS = flags.DEFINE_integer("prompts", 8, "Decode prompts.")
_NEW = flags.DEFINE_integer("new_tokens", 128, "Decode tokens per prompt.")
_THREADS = flags.DEFINE_integer("threads", 2, "torch threads (this machine's cores).")
EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def model_config():
    from composer_jax import presets

    return dataclasses.replace(
        presets.tiny().model,
        vocab_size=2048,
        hidden_size=256,
        num_layers=4,
        first_k_dense=1,
        num_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_experts=16,
        num_experts_per_tok=4,
        num_shared_experts=1,
        n_group=1,
        topk_group=1,
        num_mtp_layers=0,
        dtype="float32",
        param_dtype="float32",
    )


def _median_seconds(fn, repeats: int) -> float:
    for _ in range(2):  # warm-up: compilation (a jitted step retraces once on its own output)
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ours(folder: str, tokens, prompts, repeats: int) -> dict:
    """Train-step and decode seconds of this project on the checkpoint."""
    import functools

    import jax
    import jax.numpy as jnp

    from composer_jax import config as config_lib
    from composer_jax import interop, model, optim
    from composer_jax.infer import InferenceEngine, SamplingParams
    from composer_jax.train import step as step_lib

    m = interop.load_hf_checkpoint(folder)
    opt_cfg = config_lib.OptimizerConfig(name="adamw", warmup_steps=0)
    schedule = optim.learning_rate_schedule(opt_cfg, 1000)
    optimizer = optim.make_optimizer(opt_cfg, schedule)
    graphdef, _, _ = step_lib.split_model(m)
    state = step_lib.init_train_state(m, optimizer)
    rows, length = tokens.shape
    batch = {
        "tokens": jnp.asarray(tokens, jnp.int32),
        "segment_ids": jnp.ones((rows, length), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length)),
    }
    train = jax.jit(
        functools.partial(
            step_lib.train_step,
            graphdef,
            optimizer,
            m.cfg,
            config_lib.TrainConfig(),
            schedule,
            None,
        )
    )
    holder = {"state": state}

    def train_once():
        holder["state"], metrics = train(holder["state"], batch)
        jax.block_until_ready(metrics)

    engine = InferenceEngine(m, num_slots=len(prompts), max_len=256, prefill_buckets=(32, 256))
    params = SamplingParams(temperature=0.0, max_new_tokens=_NEW.value)

    def decode_once():
        return engine.generate([list(map(int, p)) for p in prompts], params)

    return {
        "train_s": _median_seconds(train_once, repeats),
        "decode_s": _median_seconds(decode_once, repeats),
        "logits": jax.device_get(model.compute_logits(m, tokens)),
    }


def theirs(folder: str, tokens, prompts, repeats: int, implementation: str) -> dict:
    """The same with transformers, one experts implementation."""
    import torch
    import transformers

    torch.set_num_threads(_THREADS.value)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=torch.float32,
        attn_implementation="sdpa",
        experts_implementation=implementation,
    )
    ids = torch.tensor(tokens)
    with torch.no_grad():
        logits = hf(ids).logits.numpy()
    hf.train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-4)

    def train_once():
        optimizer.zero_grad()
        hf(ids, labels=ids).loss.backward()
        optimizer.step()

    hf.eval()
    prompt_ids = torch.tensor(prompts)

    def decode_once():
        with torch.no_grad():
            hf.generate(
                prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                max_new_tokens=_NEW.value,
                min_new_tokens=_NEW.value,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )

    hf.train()
    train_s = _median_seconds(train_once, repeats)
    hf.eval()
    return {"train_s": train_s, "decode_s": _median_seconds(decode_once, repeats), "logits": logits}


def main(argv):
    del argv
    import numpy as np

    from composer_jax import interop
    from composer_jax.model import init_model

    rng = np.random.default_rng(0)
    cfg = model_config()
    tokens = rng.integers(0, cfg.vocab_size, (_BATCH.value, _SEQ.value))
    prompts = rng.integers(0, cfg.vocab_size, (_PROMPTS.value, 16))
    with tempfile.TemporaryDirectory(prefix="bench_vs_torch_") as folder:
        interop.export_hf_checkpoint(init_model(cfg, seed=0), folder)
        here = ours(folder, tokens, prompts, _REPEATS.value)
        peers = {}
        for implementation in EXPERTS_IMPLEMENTATIONS:
            try:
                peers[implementation] = theirs(
                    folder, tokens, prompts, _REPEATS.value, implementation
                )
            except Exception as error:  # an implementation this transformers lacks
                print(f"transformers experts_implementation={implementation}: {error}"[:200])
    for implementation, peer in peers.items():
        gap = float(np.abs(peer["logits"] - here["logits"]).max())
        if gap > 1e-4:
            raise SystemExit(f"logits differ from transformers ({implementation}) by {gap:.2e}")
    train_tokens = _BATCH.value * _SEQ.value
    decode_tokens = _PROMPTS.value * _NEW.value
    print(f"logits equal within 1e-4 for {', '.join(peers)}; float32, {_THREADS.value} threads")
    print("| side | train step (s) | train tokens/s | decode (s) | decode tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    rows = {"composer-jax": here} | {f"transformers ({k})": v for k, v in peers.items()}
    for name, r in rows.items():
        print(
            f"| {name} | {r['train_s']:.3f} | {train_tokens / r['train_s']:.0f} | "
            f"{r['decode_s']:.2f} | {decode_tokens / r['decode_s']:.0f} |"
        )
    best_train = min(peers, key=lambda k: peers[k]["train_s"])
    best_decode = min(peers, key=lambda k: peers[k]["decode_s"])
    print(
        f"ours / theirs: train step {peers[best_train]['train_s'] / here['train_s']:.2f}x "
        f"(best peer: {best_train}), decode {peers[best_decode]['decode_s'] / here['decode_s']:.2f}x "
        f"(best peer: {best_decode})"
    )


if __name__ == "__main__":
    app.run(main)
