r"""This project against Hugging Face transformers on one random DeepSeek-V3 checkpoint (the `golden`
extra, which the README's set-up installs: transformers and torch).

One random model (MLA with q and kv LoRA, 16 routed experts top-4, a shared expert, a dense first
layer, no MTP) is exported once in float32 and loaded by both sides in `--dtype` (parameters and
compute; bfloat16: both train bf16 parameters). First the logits of one batch are checked equal
(within 1e-4 in float32; in bfloat16 each side's error against the float32 logits, ours at most
twice the best peer's); then, on this CPU, medians over `--repeats`:
  train step   forward + backward + AdamW on the same batch (transformers: model(labels=...)
               .loss.backward(), torch.optim.AdamW; here: the pretraining step, MTP off)
  decode       greedy, cached, for each `--decode` shape PROMPTSxNEW: PROMPTS prompts of 16
               tokens, NEW tokens each (ours `--decode_chunk` steps per jitted call)
The peer runs each experts implementation transformers offers with sdpa attention, eager and
(with --compile) under torch.compile; the fastest is kept and named for each measurement (with
--screen, the default, each runs once briefly and only those near the fastest are timed in
full), and a configuration that fails is reported and skipped. Ratios are ours / theirs in
tokens per second (above 1: faster here).

  PYTHONPATH=. python experiments/bench_vs_torch.py [--repeats=5]
      [--dtype=bfloat16] [--decode=8x128,32x128,8x1024,32x1024] [--compile] [--profile]

--profile prints the slowest ops of our forward + backward (XLA's own, from a jax.profiler trace)
and of the best peer's (torch's profiler), the table behind RESULTS' account of the gap.
"""

import dataclasses
import statistics
import tempfile
import time

from absl import app, flags

from experiments import op_profile

_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repeats (after two warm-ups).")
_BATCH = flags.DEFINE_integer("batch", 4, "Train-step batch (rows).")
_SEQ = flags.DEFINE_integer("seq_len", 256, "Train-step row length.")
_DECODE = flags.DEFINE_list("decode", ["8x128"], "Decode shapes, PROMPTSxNEW_TOKENS each.")
_DECODE_CHUNK = flags.DEFINE_integer(
    "decode_chunk", 8, "Our engine's decode steps per jitted call (the peer syncs every token)."
)
_ATTENTION_BLOCK = flags.DEFINE_integer(
    "attention_block",
    256,
    "Keys per block of our training step's attention (model.attention_block_size; 0: dense).",
)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameters and compute.")
_COMPILE = flags.DEFINE_bool("compile", False, "Also time the peer under torch.compile.")
_BREAKDOWN = flags.DEFINE_bool(
    "breakdown", False, "Also time the train step's forward and forward + backward alone."
)
# Variants of the benchmarked model that locate our backward's cost (`--variants`): flag name ->
# (the report's label, model fields changed).
VARIANTS = {
    "benchmarked": ("as benchmarked", {}),
    "dense": ("every layer dense (no MoE)", {"first_k_dense": 4}),  # model_config()'s 4 layers
    "unrolled": ("layers unrolled instead of scanned", {"scan_layers": False}),
    "2_layers": ("2 layers instead of 4", {"num_layers": 2}),
    "dense_narrow": (
        "every layer dense, MLP 16 wide",
        {"first_k_dense": 4, "intermediate_size": 16},
    ),
}
_VARIANTS = flags.DEFINE_multi_enum(
    "variants",
    [],
    [*VARIANTS, "all"],
    "Also time our forward and forward + backward on these variants of the model (repeatable; "
    "'all': every one).",
)
_PROFILE = flags.DEFINE_bool(
    "profile", False, "Also print each side's slowest ops in forward + backward (op_profile)."
)
_SCREEN = flags.DEFINE_bool(
    "screen",
    True,
    "Run every peer configuration once on a short decode first; time in full only those near "
    "the fastest.",
)
_THREADS = flags.DEFINE_integer("threads", 2, "torch threads (this machine's cores).")
EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
PROMPT_LEN = 16
SCREEN_NEW_TOKENS = 32  # new tokens per decode shape in --screen's one run of each peer
# One screening run is noisy: every configuration within this factor of the fastest for some
# measurement is timed in full.
SCREEN_MARGIN = 1.25
TOLERANCE = 1e-4  # max |logits difference| in float32
# In bfloat16 the two sides round differently, so each is compared with the float32 logits of
# the same checkpoint instead: ours may err at most this many times the best peer's error.
BF16_ERROR_RATIO = 2.0


def decode_shapes() -> list[tuple[int, int]]:
    """(prompts, new tokens) of each --decode entry."""
    try:
        return [tuple(int(n) for n in shape.split("x")) for shape in _DECODE.value]
    except ValueError:
        raise app.UsageError(f"--decode takes PROMPTSxNEW entries, got {_DECODE.value}") from None


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
    for _ in range(2):  # warm-up: compilation and first-call costs
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ours(folder: str, tokens, prompts, repeats: int) -> dict:
    """Train-step and decode seconds (per decode shape) of this project on the checkpoint."""
    import jax
    import jax.numpy as jnp

    from composer_jax import interop, model

    m = interop.load_hf_checkpoint(folder, dtype=_DTYPE.value, param_dtype=_DTYPE.value)
    train_s, breakdown, ops = _our_train_step(m, tokens, repeats)
    logits = model.compute_logits(m, tokens).astype(jnp.float32)
    return {
        "train_s": train_s,
        "decode_s": _our_decode(m, prompts, repeats),
        "logits": jax.device_get(logits),
        "breakdown": breakdown,
        "ops": ops,
    }


def _our_train_step(m, tokens, repeats: int) -> tuple[float, dict, list]:
    """(train-step seconds, forward and forward + backward seconds with --breakdown, the loss
    gradient's op times with --profile)."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from composer_jax import config as config_lib
    from composer_jax import optim
    from composer_jax.model import Transformer
    from composer_jax.model.layers import logical_axes_of
    from composer_jax.train import step as step_lib

    opt_cfg = config_lib.OptimizerConfig(name="adamw", warmup_steps=0)
    schedule = optim.learning_rate_schedule(opt_cfg, 1000)
    # The checkpoint's parameters in a model of the same architecture with our attention choice.
    block = _ATTENTION_BLOCK.value or None
    graphdef, params, _ = step_lib.split_model(
        nnx.eval_shape(
            lambda: Transformer(dataclasses.replace(m.cfg, attention_block_size=block), nnx.Rngs(0))
        )
    )
    optimizer = optim.make_optimizer(opt_cfg, schedule, logical_axes_of(params), verbose=False)
    holder = {"state": step_lib.init_train_state(m, optimizer)}
    rows, length = tokens.shape
    batch = {
        "tokens": jnp.asarray(tokens, jnp.int32),
        "segment_ids": jnp.ones((rows, length), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length)),
    }
    train_cfg = config_lib.TrainConfig()
    train = jax.jit(
        functools.partial(
            step_lib.train_step, graphdef, optimizer, m.cfg, train_cfg, schedule, None
        )
    )

    def train_once():
        holder["state"], metrics = train(holder["state"], batch)
        jax.block_until_ready(metrics)

    def loss(params):
        merged = nnx.merge(graphdef, params, holder["state"].buffers)
        return step_lib.pretrain_loss(merged, batch, train_cfg)[0]

    phases = {"forward": jax.jit(loss), "forward + backward": jax.jit(jax.grad(loss))}
    breakdown = {
        name: _median_seconds(
            lambda f=fn: jax.block_until_ready(f(holder["state"].params)), repeats
        )
        for name, fn in (phases.items() if _BREAKDOWN.value else ())
    }
    ops = (
        op_profile.xla_op_times(jax.grad(loss), holder["state"].params, repeats=repeats)
        if _PROFILE.value
        else []
    )
    return _median_seconds(train_once, repeats), breakdown, ops


def _our_decode(m, prompts, repeats: int) -> dict:
    """Greedy decode seconds per (prompts, new tokens) shape, one engine per shape."""
    import functools

    from composer_jax.infer import InferenceEngine, SamplingParams

    decode_s = {}
    for (count, new), batch_prompts in prompts.items():
        max_len = PROMPT_LEN + new + 8
        engine = InferenceEngine(
            m,
            num_slots=count,
            max_len=max_len,
            prefill_buckets=(32, max_len),
            decode_chunk=_DECODE_CHUNK.value,
        )
        params = SamplingParams(temperature=0.0, max_new_tokens=new)
        decode = functools.partial(
            engine.generate, [list(map(int, p)) for p in batch_prompts], params
        )
        decode_s[count, new] = _median_seconds(decode, repeats)
    return decode_s


def theirs(
    folder: str, tokens, prompts, repeats: int, implementation: str, compiled: bool, quick=False
):
    """The same with transformers, one experts implementation, eager or under torch.compile;
    `quick`: once, decoding at most SCREEN_NEW_TOKENS a shape, no breakdown or profile."""
    import torch
    import transformers

    torch.set_num_threads(_THREADS.value)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=getattr(torch, _DTYPE.value),
        attn_implementation="sdpa",
        experts_implementation=implementation,
    )
    if compiled:
        hf.forward = torch.compile(hf.forward)
    ids = torch.tensor(tokens)
    with torch.no_grad():
        logits = hf(ids).logits.float().numpy()
    hf.train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-4)

    def train_once():
        optimizer.zero_grad()
        hf(ids, labels=ids).loss.backward()
        optimizer.step()

    def forward():
        hf(ids, labels=ids).loss.item()

    def forward_backward():
        optimizer.zero_grad()
        hf(ids, labels=ids).loss.backward()

    phases = {"forward": forward, "forward + backward": forward_backward}
    breakdown = {
        name: _median_seconds(fn, repeats)
        for name, fn in (phases.items() if _BREAKDOWN.value and not quick else ())
    }
    profiled = _PROFILE.value and not quick
    ops = op_profile.torch_op_times(forward_backward, repeats) if profiled else []

    def decode(prompt_ids, new: int):
        with torch.no_grad():
            hf.generate(
                prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )

    train_s = _median_seconds(train_once, repeats)
    hf.eval()
    decode_s = {
        (count, new): _median_seconds(
            lambda p=torch.tensor(batch_prompts), n=new: decode(
                p, min(n, SCREEN_NEW_TOKENS) if quick else n
            ),
            repeats,
        )
        for (count, new), batch_prompts in prompts.items()
    }
    return {
        "train_s": train_s,
        "decode_s": decode_s,
        "logits": logits,
        "breakdown": breakdown,
        "ops": ops,
    }


def _time_peers(configs: dict, folder: str, tokens, prompts, repeats: int, quick: bool):
    """`theirs` for each named (implementation, compiled); one this transformers or torch cannot
    run is reported and left out."""
    results = {}
    for name, (implementation, compiled) in configs.items():
        try:
            results[name] = theirs(
                folder, tokens, prompts, repeats, implementation, compiled, quick
            )
        except Exception as error:  # an implementation this transformers lacks
            print(f"transformers ({name}): {type(error).__name__}: {error}"[:300])
            continue
        decode = {f"{c}x{n}": round(t, 3) for (c, n), t in results[name]["decode_s"].items()}
        print(f"{'screened' if quick else 'timed'} transformers ({name}): train "
              f"{results[name]['train_s']:.3f} s, decode s {decode}", flush=True)  # fmt: skip
    return results


def peers(folder: str, tokens, prompts, repeats: int) -> tuple[dict, dict]:
    """(timed, screened): every experts implementation, eager and (with --compile) compiled.
    With --screen every configuration first runs once, decoding SCREEN_NEW_TOKENS a shape, and
    only those near the fastest (SCREEN_MARGIN) for some measurement are timed in full (the
    slowest would take most of a full run's time: batched_mm trains 40x slower); without it
    every one is timed."""
    configs = {
        implementation + (", torch.compile" if compiled else ""): (implementation, compiled)
        for compiled in ((False, True) if _COMPILE.value else (False,))
        for implementation in EXPERTS_IMPLEMENTATIONS
    }
    if not _SCREEN.value:
        return _time_peers(configs, folder, tokens, prompts, repeats, quick=False), {}
    screened = _time_peers(configs, folder, tokens, prompts, 1, quick=True)
    times = [{name: r["train_s"] for name, r in screened.items()}] + [
        {name: r["decode_s"][shape] for name, r in screened.items()} for shape in prompts
    ]
    near_fastest = {name for t in times for name in t if t[name] <= SCREEN_MARGIN * min(t.values())}
    chosen = {name: configs[name] for name in configs if name in near_fastest}
    return _time_peers(chosen, folder, tokens, prompts, repeats, quick=False), screened


def variant_seconds(tokens, names: list[str], repeats: int) -> dict[str, tuple[float, float]]:
    """Label -> (forward, forward + backward) seconds of our loss on each named VARIANTS model
    (random weights, --dtype), on the train step's batch: where the backward's time goes."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from composer_jax import config as config_lib
    from composer_jax.model import init_model
    from composer_jax.train import step as step_lib

    rows, length = tokens.shape
    batch = {
        "tokens": jnp.asarray(tokens, jnp.int32),
        "segment_ids": jnp.ones((rows, length), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length)),
    }
    out = {}
    for name in names:
        label, fields = VARIANTS[name]
        cfg = dataclasses.replace(
            model_config(), dtype=_DTYPE.value, param_dtype=_DTYPE.value, **fields
        )
        graphdef, params, buffers = step_lib.split_model(init_model(cfg, 0))

        def loss(p, graphdef=graphdef, buffers=buffers):
            merged = nnx.merge(graphdef, p, buffers)
            return step_lib.pretrain_loss(merged, batch, config_lib.TrainConfig())[0]

        out[label] = tuple(
            _median_seconds(lambda f=f: jax.block_until_ready(f(params)), repeats)
            for f in (jax.jit(loss), jax.jit(jax.grad(loss)))
        )
    return out


def main(argv):
    del argv
    import numpy as np

    from composer_jax import interop, model
    from composer_jax.model import init_model

    rng = np.random.default_rng(0)
    cfg = model_config()
    tokens = rng.integers(0, cfg.vocab_size, (_BATCH.value, _SEQ.value))
    prompts = {
        shape: rng.integers(0, cfg.vocab_size, (shape[0], PROMPT_LEN)) for shape in decode_shapes()
    }
    with tempfile.TemporaryDirectory(prefix="bench_vs_torch_") as folder:
        interop.export_hf_checkpoint(init_model(cfg, seed=0), folder)
        reference = np.asarray(model.compute_logits(interop.load_hf_checkpoint(folder), tokens))
        here = ours(folder, tokens, prompts, _REPEATS.value)
        others, screened = peers(folder, tokens, prompts, _REPEATS.value)
    check_parity(reference, here, screened | others)
    report(here, others, prompts)
    if _VARIANTS.value:
        names = list(VARIANTS) if "all" in _VARIANTS.value else _VARIANTS.value
        print(
            "our loss on variants of the model (s): forward; forward + backward; backward / forward"
        )
        for name, (forward, both) in variant_seconds(tokens, names, _REPEATS.value).items():
            print(f"| {name} | {forward:.3f} | {both:.3f} | {(both - forward) / forward:.1f} |")


def check_parity(reference, here: dict, others: dict[str, dict]) -> None:
    """float32: every side's logits within TOLERANCE of ours; bfloat16: ours no further from the
    float32 reference than BF16_ERROR_RATIO x the closest peer. Exits naming the failure."""
    import numpy as np

    def error(logits) -> float:
        return float(np.abs(logits - reference).max())

    if _DTYPE.value == "float32":
        for name, peer in others.items():
            gap = float(np.abs(peer["logits"] - here["logits"]).max())
            if gap > TOLERANCE:
                raise SystemExit(f"logits differ from transformers ({name}) by {gap:.2e}")
        print(f"logits equal within 0.0001 for {', '.join(others)}; float32", end="")
    else:
        theirs_error = min(error(peer["logits"]) for peer in others.values())
        if error(here["logits"]) > BF16_ERROR_RATIO * theirs_error:
            raise SystemExit(
                f"bfloat16 logits err {error(here['logits']):.3f} from float32, the closest "
                f"peer {theirs_error:.3f}"
            )
        print(
            f"bfloat16 logits' largest error from float32: ours {error(here['logits']):.3f}, "
            f"the closest peer {theirs_error:.3f}",
            end="",
        )
    print(f", {_THREADS.value} torch threads")


def report(here: dict, others: dict[str, dict], prompts: dict) -> None:
    """Seconds and tokens/s of each side, then ours / the best peer for each measurement."""
    train_tokens = _BATCH.value * _SEQ.value
    shapes = list(prompts)
    header = " | ".join(f"decode {c}x{n} tokens/s" for c, n in shapes)
    print(f"| side | train step (s) | train tokens/s | {header} |")
    print("| --- | ---: | ---: |" + " ---: |" * len(shapes))
    rows = {"composer-jax": here} | {f"transformers ({k})": v for k, v in others.items()}
    for name, r in rows.items():
        rates = " | ".join(f"{c * n / r['decode_s'][c, n]:.0f}" for c, n in shapes)
        print(f"| {name} | {r['train_s']:.3f} | {train_tokens / r['train_s']:.0f} | {rates} |")
    best = min(others, key=lambda k: others[k]["train_s"])
    parts = [f"train step {others[best]['train_s'] / here['train_s']:.2f}x (best peer: {best})"]
    for shape in shapes:
        peer = min(others, key=lambda k: others[k]["decode_s"][shape])
        ratio = others[peer]["decode_s"][shape] / here["decode_s"][shape]
        parts.append(f"decode {shape[0]}x{shape[1]} {ratio:.2f}x (best peer: {peer})")
    print("ours / theirs: " + ", ".join(parts))
    if here["breakdown"]:
        print("train step in parts (s): forward; forward + backward; the whole step")
        for name, r in rows.items():
            parts = [r["breakdown"]["forward"], r["breakdown"]["forward + backward"], r["train_s"]]
            print(f"| {name} | " + " | ".join(f"{p:.3f}" for p in parts) + " |")
    if here["ops"]:
        for name, ops in (("ours", here["ops"]), (f"transformers ({best})", others[best]["ops"])):
            kinds = list(op_profile.by_opcode(ops).items())[:6]
            kinds = ", ".join(f"{k} {ms:.1f}" for k, ms in kinds)
            print(f"slowest ops of forward + backward, {name} (ms by kind: {kinds}):")
            print(op_profile.format_ops(ops))
        print("our matrix products by operation and pass (the GEMM library's and XLA's dots):")
        print(op_profile.format_products(op_profile.by_product(here["ops"])))


if __name__ == "__main__":
    app.run(main)
