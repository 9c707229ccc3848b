r"""Inference engine benchmark: cache memory, cached vs recomputed decode, continuous batching.

All ratios compare configurations measured in the same run on the same machine:
1. latent-cache bytes per token against a full per-head K/V cache, for the model presets;
2. single-sequence decode tokens/s at each context length: MLA latent cache (absorbed and
   expanded attention) against re-running the whole forward for every token;
3. continuous batching (num_slots sequences in flight, requests joining as others finish) against
   serving the same requests one at a time;
4. MTP speculative decoding: acceptance rate and tokens per main-model pass;
5. decode steps per jitted call (`decode_chunk`): tokens/s at each chunk against one step per
   call, with every slot decoding to the same length and with requests of mixed lengths joining
   as others finish (a slot freed mid-chunk idles until the chunk ends);
6. two ops of a decode step written two ways, at the RL sampler's shapes (`--tables=forms`, not
   in the default set): the absorbed attention's weighted sum as the einsum it was against the
   batched matmul it is, and drawing a token with the nucleus sort against without it (top_p 1);
7. a fresh prompt's prefill chunk at the RL main job's shapes reading no cached positions (what
   the engine does) against reading the whole empty cache (what it did), `--tables=prefill`.

  python experiments/bench_decode.py [--contexts=256,1024] [--decode_steps=32] [--requests=32]
      [--tables=cache,decode,batching,speculative,chunks,forms,prefill] [--chunks=1,4,8,16]
      [--prefill_rows=1,8]
"""

import dataclasses
import time

from absl import app, flags

_CONTEXTS = flags.DEFINE_list("contexts", ["256", "1024"], "Context lengths for decode speed.")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 32, "Timed tokens per decode measurement.")
_REQUESTS = flags.DEFINE_integer("requests", 32, "Requests in the batching comparison.")
_SLOTS = flags.DEFINE_integer("slots", 8, "Cache slots for continuous batching.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats per measurement; the best counts.")
_TABLES = flags.DEFINE_list(
    "tables", ["cache", "decode", "batching", "speculative", "chunks"], "Tables to print."
)
_CHUNKS = flags.DEFINE_list("chunks", ["1", "4", "8", "16"], "decode_chunk values, baseline first.")
_FORM_CALLS = flags.DEFINE_integer("form_calls", 50, "Calls per timed repeat in the forms table.")
_PREFILL_ROWS = flags.DEFINE_list("prefill_rows", ["1", "8"], "Rows of the prefill table's chunks.")


def _best_seconds(run) -> float:
    """Fastest of `--repeats` timed calls: the machine may be shared, noise only slows down."""
    times = []
    for _ in range(_REPEATS.value):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def _model_cfg():
    from composer_jax import presets

    return dataclasses.replace(presets.tiny().model, dtype="float32")


def cache_table() -> None:
    from composer_jax import presets
    from composer_jax.infer import cache_bytes_per_token, full_kv_bytes_per_token

    print("\n== KV cache bytes per token (all layers) ==")
    print(f"{'model':<10}{'dtype':<10}{'latent cache':>14}{'full K/V':>12}{'ratio':>8}")
    presets = [("tiny", presets.tiny().model), ("small", presets.small().model)]
    presets.append(("kimi_k2", presets.kimi_k2().model))
    for name, cfg in presets:
        latent, full = cache_bytes_per_token(cfg), full_kv_bytes_per_token(cfg)
        formula = f"({cfg.kv_lora_rank}+{cfg.qk_rope_head_dim})*{cfg.num_layers}*bytes"
        print(f"{name:<10}{cfg.dtype:<10}{latent:>14,}{full:>12,}{full / latent:>7.1f}x  {formula}")


def _time_engine_decode(model, context: int, steps: int, absorbed: bool) -> float:
    """Tokens/s of one sequence decoding after a `context`-token prompt (compile excluded)."""
    from composer_jax.infer import InferenceEngine, SamplingParams

    engine = InferenceEngine(
        model,
        num_slots=1,
        max_len=context + steps + 2,
        prefill_buckets=(context,),
        absorbed=absorbed,
    )
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 1)
    prompt = [1 + i % 200 for i in range(context)]
    engine.compile_all()
    best = float("inf")
    for _ in range(_REPEATS.value):
        engine.submit(prompt, params)
        engine.step()  # prefill and the first token, not timed
        start = time.perf_counter()
        while engine.has_work:
            engine.step()
        best = min(best, time.perf_counter() - start)
    return steps / best


def _time_recompute_decode(model, context: int, steps: int) -> float:
    from composer_jax.infer import SamplingParams, recompute_generate

    prompt = [1 + i % 200 for i in range(context)]
    max_len = context + steps + 2
    recompute_generate(model, prompt, SamplingParams(temperature=0.0, max_new_tokens=1), max_len)
    start = time.perf_counter()
    recompute_generate(
        model, prompt, SamplingParams(temperature=0.0, max_new_tokens=steps), max_len
    )
    return steps / (time.perf_counter() - start)


def decode_table(model, contexts: list[int], steps: int) -> None:
    print(f"\n== Single-sequence decode tokens/s ({steps} tokens, tiny float32, CPU) ==")
    header = f"{'context':>8}{'recompute':>12}{'cache':>10}{'cache (expanded)':>18}{'cache / recompute':>19}"
    print(header)
    for context in contexts:
        recompute = _time_recompute_decode(model, context, steps)
        cached = _time_engine_decode(model, context, steps, absorbed=True)
        expanded = _time_engine_decode(model, context, steps, absorbed=False)
        print(
            f"{context:>8}{recompute:>12.1f}{cached:>10.1f}{expanded:>18.1f}"
            f"{cached / recompute:>18.1f}x"
        )


def batching_table(model, requests: int, slots: int) -> None:
    import numpy as np

    from composer_jax.infer import InferenceEngine, SamplingParams

    rng = np.random.default_rng(0)
    work = [
        (
            rng.integers(1, 250, size=int(rng.integers(8, 60))).tolist(),
            SamplingParams(temperature=1.0, max_new_tokens=int(rng.integers(16, 64)), seed=i),
        )
        for i in range(requests)
    ]
    total = sum(p.max_new_tokens for _, p in work)
    print(f"\n== Continuous batching: {requests} requests, {total} generated tokens ==")
    print(f"{'mode':<28}{'seconds':>9}{'tokens/s':>10}")
    results = {}
    for label, num_slots in (("one at a time (1 slot)", 1), (f"continuous ({slots} slots)", slots)):
        engine = InferenceEngine(model, num_slots=num_slots, max_len=128, prefill_buckets=(16, 64))
        engine.compile_all()

        def serve():
            for prompt, params in work:
                engine.submit(prompt, params)
            engine.run()

        seconds = _best_seconds(serve)
        results[label] = total / seconds
        print(f"{label:<28}{seconds:>9.2f}{total / seconds:>10.1f}")
    one, many = results.values()
    print(f"continuous / one-at-a-time: {many / one:.1f}x")


def speculative_table(model) -> None:
    import numpy as np

    from composer_jax.infer import SamplingParams, speculative_generate

    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 250, size=16).tolist() for _ in range(8)]
    print("\n== MTP speculative decoding (untrained tiny model: MTP head is random) ==")
    for temperature in (0.0, 1.0):
        params = [
            SamplingParams(temperature=temperature, max_new_tokens=32, seed=i) for i in range(8)
        ]
        outs, stats = speculative_generate(model, prompts, params, max_len=64, prompt_bucket=16)
        tokens = sum(len(c.tokens) for c in outs) - len(outs)  # first token comes from prefill
        per_pass = tokens / max(stats.drafted, 1)
        print(
            f"temperature {temperature}: acceptance {stats.acceptance_rate:.3f}, "
            f"{per_pass:.2f} tokens per verification pass"
        )


def _chunk_workloads(requests: int, slots: int):
    """(label, requests as (prompt, params)): every slot decoding 224 tokens after an 8-token
    prompt, and `requests` of mixed prompt (8-60) and generation (16-64) lengths."""
    import numpy as np

    from composer_jax.infer import SamplingParams

    rng = np.random.default_rng(2)
    equal = [
        (rng.integers(1, 250, size=8).tolist(), SamplingParams(max_new_tokens=224, seed=i))
        for i in range(slots)
    ]
    mixed = [
        (
            rng.integers(1, 250, size=int(rng.integers(8, 60))).tolist(),
            SamplingParams(max_new_tokens=int(rng.integers(16, 64)), seed=i),
        )
        for i in range(requests)
    ]
    return [(f"{slots} x 224 tokens", equal), (f"{requests} mixed requests", mixed)]


def chunk_table(model, requests: int, slots: int, chunks: list[int]) -> None:
    """Serving tokens/s (prefill included, compile excluded) per decode_chunk, vs the first.
    The chunks take turns within each repeat, so load on a shared machine hits them alike."""
    from composer_jax.infer import InferenceEngine

    engines = {}
    for chunk in chunks:
        engines[chunk] = InferenceEngine(
            model, num_slots=slots, max_len=256, prefill_buckets=(16, 64), decode_chunk=chunk
        )
        engines[chunk].compile_all()
    print(f"\n== Decode steps per jitted call ({slots} slots, temperature 1, tiny float32) ==")
    print(f"{'workload':<22}{'decode_chunk':>13}{'seconds':>9}{'tokens/s':>10}{'vs first':>10}")
    for label, work in _chunk_workloads(requests, slots):
        best = dict.fromkeys(chunks, float("inf"))
        for _ in range(_REPEATS.value):
            for chunk, engine in engines.items():
                start = time.perf_counter()
                for prompt, params in work:
                    engine.submit(prompt, params)
                engine.run()
                best[chunk] = min(best[chunk], time.perf_counter() - start)
        total = sum(p.max_new_tokens for _, p in work)
        for chunk, seconds in best.items():
            ratio = best[chunks[0]] / seconds
            print(f"{label:<22}{chunk:>13}{seconds:>9.3f}{total / seconds:>10.1f}{ratio:>9.2f}x")


def _ms_per_call(fn, *args) -> float:
    """Milliseconds per call of a jitted `fn`, compiled first; the best of `--repeats`."""
    import jax

    jax.block_until_ready(fn(*args))

    def calls():
        for _ in range(_FORM_CALLS.value):
            out = fn(*args)
        jax.block_until_ready(out)

    return 1e3 * _best_seconds(calls) / _FORM_CALLS.value


def forms_table() -> None:
    """Same op, two spellings, at `rl_tiny`'s sampler shapes (its slots and context, bf16): what
    XLA:CPU makes of each. The baseline row of each pair is the spelling the engine used before."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from composer_jax import presets
    from composer_jax.infer.sampling import sample, token_keys

    preset = presets.rl_tiny()
    model, slots, positions = (
        preset.model,
        preset.rl.rollout.num_slots,
        preset.rl.rollout.context_len,
    )
    dtype = jnp.dtype(model.dtype)
    k_probs, k_cache, k_logits = jax.random.split(jax.random.key(0), 3)
    scores = jax.random.normal(k_probs, (slots, model.num_heads, 1, positions))
    probs_BHTS = jax.nn.softmax(scores, axis=-1).astype(dtype)
    c_kv_BSR = jax.random.normal(k_cache, (slots, positions, model.kv_lora_rank)).astype(dtype)

    @jax.jit
    def weighted_sum_einsum(probs, c_kv):
        return jnp.einsum("bhts,bsr->bthr", probs, c_kv)

    @jax.jit
    def weighted_sum_matmul(probs, c_kv):
        B, H, T, S = probs.shape
        out_BHTR = jnp.matmul(probs.reshape(B, H * T, S), c_kv).reshape(B, H, T, -1)
        return out_BHTR.transpose(0, 2, 1, 3)

    reference = np.einsum(  # float32 products of the same bf16 inputs
        "bhts,bsr->bthr", np.asarray(probs_BHTS, np.float32), np.asarray(c_kv_BSR, np.float32)
    )
    errors = {
        name: np.max(np.abs(np.asarray(form(probs_BHTS, c_kv_BSR), np.float32) - reference))
        for name, form in (("einsum", weighted_sum_einsum), ("matmul", weighted_sum_matmul))
    }
    logits_BV = jax.random.normal(k_logits, (slots, model.vocab_size)) * 3
    temperature_B = jnp.ones(slots)
    keys_B = token_keys(jnp.arange(slots), jnp.zeros(slots, jnp.int32))
    draw = jax.jit(sample)
    rows = [
        (
            "weighted sum: einsum bhts,bsr->bthr",
            _ms_per_call(weighted_sum_einsum, probs_BHTS, c_kv_BSR),
        ),
        (
            "weighted sum: [B, H*T, S] @ [B, S, R]",
            _ms_per_call(weighted_sum_matmul, probs_BHTS, c_kv_BSR),
        ),
        (
            "draw, top_p 0.95 (nucleus sort)",
            _ms_per_call(draw, logits_BV, temperature_B, jnp.full(slots, 0.95), keys_B),
        ),
        (
            "draw, top_p 1 (sort skipped)",
            _ms_per_call(draw, logits_BV, temperature_B, jnp.ones(slots), keys_B),
        ),
    ]
    print(
        f"\n== Decode-step ops, two spellings ({slots} slots x {positions} positions, "
        f"{model.num_heads} heads, latent {model.kv_lora_rank}, vocab {model.vocab_size}, "
        f"{dtype.name}; ms per call, best of {_REPEATS.value} x {_FORM_CALLS.value}) =="
    )
    print("| op | ms per call | baseline / this |")
    print("| --- | ---: | ---: |")
    for index, (label, ms) in enumerate(rows):
        baseline = rows[index - index % 2][1]
        print(f"| {label} | {ms:.3f} | {baseline / ms:.2f}x |")
    print(
        f"Largest error of the weighted sums against float32 products of the same inputs: "
        f"einsum {errors['einsum']:.3g}, matmul {errors['matmul']:.3g} (outputs about "
        f"{np.abs(reference).mean():.3g} in size)"
    )


def prefill_table(rows: list[int]) -> None:
    """`rl_tiny`'s sampler (its cache length, longest prefill bucket, bf16 model): one prefill
    chunk of padding rows (the same shapes and work as prompts; they write nothing) attending
    over cache span 0 against span max_len, compiled first, the best of `--repeats` each."""
    from composer_jax import presets
    from composer_jax.infer import InferenceEngine
    from composer_jax.model import init_model

    preset = presets.rl_tiny()
    max_len, bucket = preset.rl.rollout.context_len, max(preset.rl.rollout.prefill_buckets)
    model = init_model(preset.model, seed=0)
    print(
        f"\n== A fresh prompt's prefill chunk ({bucket} tokens, cache of {max_len}, "
        f"{preset.model.dtype}; ms per call, best of {_REPEATS.value}) =="
    )
    print("| rows | whole cache read (before) | no cache read (now) | before / now |")
    print("| ---: | ---: | ---: | ---: |")
    for count in rows:
        engine = InferenceEngine(
            model,
            num_slots=count,
            max_len=max_len,
            prefill_buckets=(bucket,),
            prefill_batch_sizes=(count,),
        )
        ms = {}
        for span in (max_len, 0):
            engine._run_padding(count, bucket, span)  # compiles
            ms[span] = 1e3 * _best_seconds(lambda: engine._run_padding(count, bucket, span))
        print(f"| {count} | {ms[max_len]:.1f} | {ms[0]:.1f} | {ms[max_len] / ms[0]:.2f}x |")


def main(argv):
    del argv
    from composer_jax.model import init_model

    model = init_model(_model_cfg(), seed=0)
    tables = set(_TABLES.value)
    if "cache" in tables:
        cache_table()
    if "decode" in tables:
        decode_table(model, [int(c) for c in _CONTEXTS.value], _DECODE_STEPS.value)
    if "batching" in tables:
        batching_table(model, _REQUESTS.value, _SLOTS.value)
    if "speculative" in tables:
        speculative_table(model)
    if "chunks" in tables:
        chunk_table(model, _REQUESTS.value, _SLOTS.value, [int(c) for c in _CHUNKS.value])
    if "forms" in tables:
        forms_table()
    if "prefill" in tables:
        prefill_table([int(r) for r in _PREFILL_ROWS.value])


if __name__ == "__main__":
    app.run(main)
