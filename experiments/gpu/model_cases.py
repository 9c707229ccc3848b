"""Model-level cases of the GPU check: train step (checks and MFU), cached decode, batching.

Step and token rates are wall clock around `block_until_ready` over several steps after a warm-up
step: a train step or a decode loop is many kernels plus host work, which is what MFU and
tokens/s are about. MFU = tokens/s x training FLOPs per token (`model/accounting.py`) / the
dense bf16 peak; the roofline's best MFU for the same step is reported next to it.
"""

from __future__ import annotations

import dataclasses
import functools
import time

from composer_jax.plan import devices

# A config that fills an H200 (about 1.7B parameters, 27 GB of fp32 state): wider and deeper
# than `small`, expert GEMMs of ~6k rows per expert at batch 16 x 2048.
WIDE = dict(
    hidden_size=2048,
    num_layers=8,
    num_heads=16,
    q_lora_rank=768,
    kv_lora_rank=256,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    intermediate_size=8192,
    moe_intermediate_size=1024,
    num_experts=32,
    num_experts_per_tok=6,
    n_group=4,
    topk_group=2,
)


def kernel_backend(device_kind: str, dry_run: bool) -> str | None:
    """The expert backend that runs this device's kernels (None: no kernel backend here)."""
    if dry_run:
        return "pallas_hopper"  # interpret mode
    spec = devices.spec_for(device_kind)
    name = spec.name if spec else ""
    if name in ("H100", "H200"):
        return "pallas_hopper"
    if name in ("B200", "GB200"):
        return "pallas_blackwell"
    return None


def model_config(params: dict, ctx: dict):
    from composer_jax import presets

    base = params["preset"]
    cfg = presets.tiny().model if base in ("tiny", "dry") else presets.small().model
    if base == "wide":
        cfg = dataclasses.replace(cfg, **WIDE)
    if base == "dry":
        cfg = dataclasses.replace(cfg, num_layers=2, num_mtp_layers=0)
    precision = params.get("precision", "bf16")
    backend = "reference"
    if precision != "bf16":
        backend = kernel_backend(ctx["device_kind"], ctx["dry_run"])
        if backend is None:
            raise LookupError(f"no low-precision kernel backend for {ctx['device_kind']!r}")
    return dataclasses.replace(
        cfg, dtype="bfloat16", expert_precision=precision, expert_backend=backend
    )


def _train_setup(cfg, batch_size: int, seq_len: int, seed: int = 0):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from composer_jax import config as config_lib
    from composer_jax import optim
    from composer_jax.model import init_model
    from composer_jax.model.layers import logical_axes_of
    from composer_jax.train import step as step_lib

    opt_cfg = config_lib.OptimizerConfig(warmup_steps=0)  # every step moves the weights
    schedule = optim.learning_rate_schedule(opt_cfg, 1000)
    m = init_model(cfg, seed=seed)
    graphdef, params, _ = step_lib.split_model(m)
    optimizer = optim.make_optimizer(opt_cfg, schedule, logical_axes_of(params), verbose=False)
    state = step_lib.init_train_state(m, optimizer)
    rng = np.random.default_rng(seed)
    batch = {
        "tokens": jnp.asarray(rng.integers(0, 256, (batch_size, seq_len)), jnp.int32),
        "segment_ids": jnp.ones((batch_size, seq_len), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch_size, seq_len)),
    }
    step = functools.partial(
        step_lib.train_step, graphdef, optimizer, cfg, config_lib.TrainConfig(), schedule, None
    )
    return jax.jit(step, donate_argnums=0), state, batch


def train_check(params: dict, ctx: dict) -> dict:
    """A few steps with one expert precision: finite, and the first loss within 2% of bf16's."""
    import jax
    import numpy as np

    try:
        cfg = model_config(params, ctx)
    except LookupError as why:
        return {"status": "n/a", "reason": str(why)}
    losses = {}
    for label, c in (("bf16", dataclasses.replace(cfg, expert_precision="bf16")), ("run", cfg)):
        step, state, batch = _train_setup(c, params["batch"], params["seq_len"])
        values = []
        for _ in range(params["steps"]):
            state, metrics = step(state, batch)
            values.append(float(jax.device_get(metrics["loss"])))
        losses[label] = values
        if cfg.expert_precision == "bf16":
            break
    run = losses.get("run", losses["bf16"])
    first_gap = abs(run[0] - losses["bf16"][0]) / abs(losses["bf16"][0])
    ok = bool(np.isfinite(run).all()) and first_gap < 0.02
    return {
        "status": "ok" if ok else "fail",
        "check": {"losses": run, "first_loss_vs_bf16": first_gap, "tol": 0.02},
        "backend": cfg.expert_backend,
    }


def train_mfu(params: dict, ctx: dict) -> dict:
    import jax

    from composer_jax.model import accounting
    from experiments import roofline

    try:
        cfg = model_config(params, ctx)
    except LookupError as why:
        return {"status": "n/a", "reason": str(why)}
    batch_size, seq_len, steps = params["batch"], params["seq_len"], params["steps"]
    step, state, batch = _train_setup(cfg, batch_size, seq_len)
    start = time.perf_counter()
    state, metrics = step(state, batch)  # compile + first step
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    loss = float(jax.device_get(metrics["loss"]))
    step_s = (time.perf_counter() - start) / steps
    tokens_per_s = batch_size * seq_len / step_s
    flops_per_token = accounting.train_flops_per_token(cfg, seq_len)
    result = {
        "status": "ok" if loss == loss else "fail",  # NaN fails
        "params": accounting.count_params(cfg).total,
        "backend": cfg.expert_backend,
        "compile_s": compile_s,
        "step_ms": 1e3 * step_s,
        "tokens_per_s": tokens_per_s,
        "loss": loss,
    }
    spec = devices.spec_for(ctx["device_kind"])
    if spec is not None:
        result["mfu"] = tokens_per_s * flops_per_token / spec.peak("bf16")
        work = roofline.workload(cfg, seq_len, batch_size, cfg.expert_precision)
        pred = roofline.predict(work, spec, cfg.expert_precision)
        result["roofline_best_mfu"] = pred.best_mfu
        result["roofline_step_ms"] = 1e3 * pred.overlapped_s
    return result


def _engine(params, ctx, num_slots: int, max_len: int, buckets):
    from composer_jax.infer import InferenceEngine
    from composer_jax.model import init_model

    model = init_model(model_config(params, ctx), seed=0)
    engine = InferenceEngine(model, num_slots=num_slots, max_len=max_len, prefill_buckets=buckets)
    engine.compile_all()
    return engine


def decode(params: dict, ctx: dict) -> dict:
    """One sequence decoding `steps` tokens after a `context`-token prompt (prefill untimed)."""
    from composer_jax.infer import SamplingParams

    context, steps = params["context"], params["steps"]
    engine = _engine(params, ctx, 1, context + steps + 2, (context,))
    engine.submit(
        [1 + i % 250 for i in range(context)], SamplingParams(0.0, max_new_tokens=steps + 1)
    )
    engine.step()  # prefill and the first token
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - start
    generated = len(next(iter(engine.completions.values())).tokens)
    ok = generated == steps + 1
    return {"status": "ok" if ok else "fail", "tokens_per_s": steps / seconds, "tokens": generated}


def batching(params: dict, ctx: dict) -> dict:
    """Continuous batching: `requests` requests of mixed lengths through `slots` cache slots."""
    import numpy as np

    from composer_jax.infer import SamplingParams

    rng = np.random.default_rng(0)
    lo, hi = params["prompt_len"]
    new_lo, new_hi = params["new_tokens"]
    engine = _engine(params, ctx, params["slots"], hi + new_hi + 2, tuple(params["buckets"]))
    work = [
        (
            rng.integers(1, 250, size=int(rng.integers(lo, hi))).tolist(),
            SamplingParams(1.0, max_new_tokens=int(rng.integers(new_lo, new_hi)), seed=i),
        )
        for i in range(params["requests"])
    ]
    start = time.perf_counter()
    for prompt, sampling in work:
        engine.submit(prompt, sampling)
    done = engine.run()
    seconds = time.perf_counter() - start
    generated = sum(len(c.tokens) for c in done.values())
    wanted = sum(s.max_new_tokens for _, s in work)
    return {
        "status": "ok" if generated <= wanted and len(done) == len(work) else "fail",
        "tokens_per_s": generated / seconds,
        "generated": generated,
        "requests": len(done),
    }
