r"""Throughput ratios of the RL system in one run, each against a baseline measured in the same run.

1. Train step: the RL step (reference pass + policy-gradient step) against the pretraining step
   on the same model and batch shape (rows = groups_per_step x group_size, length = context_len).
2. Sampler: the InferenceEngine alone (same slots, prompt length and max_new_tokens, compiled
   beforehand, every slot busy) against the sampler inside a short traced actor loop (its decoded
   tokens over the loop's wall time, from the `composer_jax.trace` summary).
3. Async vs sync: the same loop at max_staleness 0 and K; the speedup against the ideal overlap
   (g + t) / max(g, t), g and t the synchronous run's generation wait and train time per step.

Timings of the loop are over steps 2..N (step 1 compiles); the sampler's numbers are given for
the whole loop and for steps 2+ (the trace clipped to after the first train step). Standalone
train steps report their fastest step. Like sync_vs_async.py, every XLA computation uses one
thread (`--xla_cpu_multi_thread_eigen=false`) unless --multi_thread.

  python -m experiments.bench_throughput [--steps=8] [--warm_start_steps=30 | --warm_start=RUN]
      [--decode_chunk=N]
"""

import dataclasses
import functools
import json
import os
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS


def ideal_speedup(generate_s: float, train_s: float) -> float:
    """Async over sync when generation and training overlap perfectly."""
    return (generate_s + train_s) / max(generate_s, train_s)


def rollout_sequences(model, rows: int, length: int, prompt_len: int) -> list:
    """One full-length sample per row, as the sampler would return it: random tokens, the
    model's own log-probs and routed experts, the first `prompt_len` tokens the prompt."""
    import jax
    import numpy as np

    from composer_jax import rl

    tokens = jax.random.randint(jax.random.key(0), (rows, length), 0, model.cfg.vocab_size)

    @jax.jit
    def sample(m, tokens):
        out = m(tokens, with_mtp=False)
        return rl.token_logprobs(m.logits(out.hidden_BTD), tokens), out.router_indices_LBTK

    logp, experts = (np.asarray(a) for a in sample(model, tokens))
    kinds = np.full(length, rl.SegmentKind.THINKING)
    kinds[:prompt_len] = rl.SegmentKind.PROMPT
    return [
        rl.Sequence(
            sample_index=b,
            tokens=np.asarray(tokens[b]),
            kinds=kinds,
            policy_mask=kinds != rl.SegmentKind.PROMPT,
            sampler_logprobs=logp[b],
            policy_versions=np.zeros(length, np.int32),
            router_indices=experts[:, b],
        )
        for b in range(rows)
    ]


def rollout_batch(model, rows: int, length: int, group_size: int, prompt_len: int):
    """`rollout_sequences` packed in groups of `group_size` with random rewards."""
    import numpy as np

    from composer_jax import rl

    sequences = rollout_sequences(model, rows, length, prompt_len)
    rewards = {"task": np.random.default_rng(0).normal(size=rows)}
    return rl.pack_trajectories(sequences, np.arange(rows) // group_size, rewards, length)


def _timed(fn, state, *args, steps: int) -> tuple[float, float]:
    """(compile seconds, seconds of the fastest of `steps` steps) of a jitted step whose first
    argument and output is the donated train state; the fastest filters out time stolen by other
    processes on a shared machine (one untimed warm-up step)."""
    import jax

    t0 = time.perf_counter()
    compiled = fn.trace(state, *args).lower().compile()
    compile_s = time.perf_counter() - t0
    state, metrics = compiled(state, *args)
    jax.block_until_ready(metrics)
    best = float("inf")
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, *args)
        jax.block_until_ready(metrics)
        best = min(best, time.perf_counter() - t0)
    return compile_s, best


def train_step_rows(cfg, steps: int, prompt_len: int) -> list[tuple[str, float, float, int]]:
    """(name, compile s, s/step, tokens/step) of the pretraining step (with and without its MTP
    heads), the RL step alone, the reference pass and the two as the trainer runs them, on
    cfg.model at [rows, context_len] (rows = groups_per_step x group_size: the loop's `min_rows`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from composer_jax.actor.trainer import rl_objective, rl_setup, rl_train_step
    from composer_jax.parallel.mesh import use_layout
    from composer_jax.rl.policy import reference_logprobs

    rows, length = (
        cfg.rl.rollout.groups_per_step * cfg.rl.rollout.group_size,
        cfg.rl.rollout.context_len,
    )
    tokens = rows * length
    setup = rl_setup(cfg)
    state = setup.init_state()
    model = nnx.merge(setup.graphdef, state.params, state.buffers)
    batch = rollout_batch(model, rows, length, cfg.rl.rollout.group_size, prompt_len)
    reference = jax.tree.map(lambda x: x.copy(), (state.params, state.buffers))
    pretrain_batch = {
        "tokens": batch.tokens_BT,
        "positions": batch.positions_BT,
        "segment_ids": batch.segment_ids_BT,
    }

    @jax.jit
    def ref_fn(params, buffers, batch):
        with use_layout(setup.layout):
            model = nnx.merge(setup.graphdef, params, buffers)
            return reference_logprobs(model, batch, cfg.rl.rollout.temperature)

    t0 = time.perf_counter()
    ref_logp = jax.block_until_ready(ref_fn(*reference, batch))
    ref_compile = time.perf_counter() - t0  # the first call compiles
    ref_s = min(_time_call(ref_fn, *reference, batch) for _ in range(steps))
    rl_step = jax.jit(
        functools.partial(
            rl_train_step,
            setup.graphdef,
            setup.optimizer,
            rl_objective(cfg.rl),
            setup.schedule,
            setup.layout,
            temperature=cfg.rl.rollout.temperature,  # as the trainer steps
        ),
        donate_argnums=0,
    )
    fresh = jax.tree.map(jnp.copy, state)
    rl_compile, rl_s = _timed(rl_step, fresh, batch, ref_logp, steps=steps)
    pre_compile, pre_s = _timed(setup.jit_train_step(), state, pretrain_batch, steps=steps)
    # Cross-entropy alone: the preset's pretraining also trains its MTP heads, which RL skips.
    plain = rl_setup(
        dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_mtp_layers=0))
    )
    ce_compile, ce_s = _timed(
        plain.jit_train_step(), plain.init_state(), pretrain_batch, steps=steps
    )
    return [
        ("pretraining step (CE + MTP, as the preset trains)", pre_compile, pre_s, tokens),
        ("pretraining step, MTP off (CE only)", ce_compile, ce_s, tokens),
        ("RL: policy-gradient step", rl_compile, rl_s, tokens),
        ("RL: reference pass", ref_compile, ref_s, tokens),
        ("RL: reference + step (trainer)", rl_compile + ref_compile, rl_s + ref_s, tokens),
    ]


def _time_call(fn, *args) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def sampler_rate(model, rl, prompt_len: int, requests: int) -> tuple[float, int]:
    """(tokens/s, tokens) of the InferenceEngine alone: `requests` random prompts sampled to
    max_new_tokens through rl.rollout.num_slots slots, every shape compiled beforehand."""
    import numpy as np

    from composer_jax.infer import InferenceEngine, SamplingParams

    engine = InferenceEngine(
        model,
        num_slots=rl.rollout.num_slots,
        max_len=rl.rollout.context_len,
        prefill_buckets=rl.rollout.prefill_buckets,
        decode_chunk=rl.rollout.decode_chunk,
    )
    engine.compile_all()
    rng = np.random.default_rng(0)
    vocab = model.cfg.vocab_size
    t0 = time.perf_counter()
    for i in range(requests):
        prompt = rng.integers(1, vocab, size=prompt_len).tolist()
        engine.submit(prompt, SamplingParams(max_new_tokens=rl.rollout.max_new_tokens, seed=i))
    done = engine.run()
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.tokens) for c in done.values())
    return tokens / seconds, tokens


def loop_run(base, name: str, max_staleness: int, warm: str) -> dict:
    """One traced actor-loop run: its per-step times (steps 2+) and its trace summary."""
    import numpy as np

    from composer_jax.actor.run import run_rl
    from composer_jax.trace import summarize
    from composer_jax.train.metrics import read_metrics

    workdir = os.path.join(FLAGS.out, name)
    trace = os.path.join(workdir, "trace.json")
    rl = dataclasses.replace(
        base.rl,
        rollout=dataclasses.replace(base.rl.rollout, max_staleness=max_staleness),
        warm_start=warm,
        trace=trace,
    )
    run_rl(dataclasses.replace(base, rl=rl, workdir=workdir), progress=True)
    lines = [
        m
        for m in read_metrics(os.path.join(workdir, "metrics.jsonl"))
        if "staleness_mean" in m and m["step"] >= 2  # step records
    ]
    with open(trace) as f:
        recorded = json.load(f)
    return dict(
        step_s=float(np.mean([m["seconds_per_step"] for m in lines])),
        train_s=float(np.mean([m["train_seconds"] for m in lines])),
        wait_s=float(np.mean([m["wait_seconds"] for m in lines])),
        summary=summarize(recorded["traceEvents"], recorded["otherData"]["wall_s"]),
        steady=steady_summary(recorded),
    )


def steady_summary(recorded: dict) -> dict:
    """The trace's summary from the end of the first train step on (steps 2+, as the step times):
    events clipped to that window, so step 1's compilation and the sampler's head start during it
    do not count."""
    from composer_jax.trace import summarize

    events = recorded["traceEvents"]
    start = min(e["ts"] + e["dur"] for e in events if e.get("cat") == "train_step")
    window = []
    for e in events:
        if e["ph"] != "X":
            window.append(e)
        elif e["ts"] + e["dur"] > start:
            begin = max(e["ts"], start)
            window.append({**e, "ts": begin - start, "dur": e["ts"] + e["dur"] - begin})
    return summarize(window, recorded["otherData"]["wall_s"] - start / 1e6)


def experiment_config():
    """rl_tiny at the flags' sizes; every group trains (a fixed workload per step)."""
    from composer_jax import presets

    base = presets.rl_tiny()
    return dataclasses.replace(
        base,
        steps=FLAGS.steps,
        rl=dataclasses.replace(
            base.rl,
            rollout=dataclasses.replace(
                base.rl.rollout,
                group_size=FLAGS.group_size,
                groups_per_step=FLAGS.groups_per_step,
                num_slots=FLAGS.num_slots,
                max_new_tokens=FLAGS.max_new_tokens,
                context_len=FLAGS.context_len,
                skip_uniform_groups=False,
                num_prompts=0,
                decode_chunk=FLAGS.decode_chunk,
            ),
            heldout=dataclasses.replace(base.rl.heldout, num_tasks=1, samples=1),
            warm_start_steps=FLAGS.warm_start_steps,
        ),
    )


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def report_train_steps(train: list, samples: int, rl) -> None:
    """Table 1: each step kind's compile time and speed against pretraining's."""
    pre_s = train[0][2]
    print(
        f"rl_tiny model, batch {samples} x {rl.rollout.context_len}, {FLAGS.train_steps} timed steps"
    )
    print(
        _table(
            ["step", "compile s", "s/step", "tokens/s", "vs pretraining"],
            [
                [n, f"{c:.1f}", f"{s:.3f}", f"{t / s:.0f}", f"{pre_s / s:.0%}"]
                for n, c, s, t in train
            ],
        ),
        flush=True,
    )


def report_sampler(results: dict, alone: float, alone_tokens: int, rl) -> None:
    """Table 2: the sampler alone against inside the asynchronous loop, and where its steps 2+
    seconds went."""
    from composer_jax.trace import SAMPLER

    rows = [["standalone engine (every slot busy)", str(alone_tokens), "", f"{alone:.0f}", "", ""]]
    for label, key in (("whole loop", "summary"), ("steps 2+", "steady")):
        summary = results["async"][key]
        wall, decoded = summary["wall_s"], summary["decoded_tokens"]
        busy = summary["busy"][SAMPLER]
        rows.append(
            [
                f"async loop, {label}",
                str(decoded),
                f"{wall:.1f}",
                f"{decoded / wall:.0f} ({decoded / wall / alone:.0%})",
                f"{decoded / (busy * wall):.0f}",
                f"{busy:.1%}",
            ]
        )
    print(
        _table(
            ["sampler", "tokens", "wall s", "tokens/s (vs alone)", "per busy s", "busy"],
            rows,
        )
    )
    steady = results["async"]["steady"]
    categories = steady["categories"]
    print(
        f"steps 2+: {steady['decode_rows_mean']:.1f} of {rl.rollout.num_slots} rows per decode step; "
        f"decode {steady['decode_ms_alone']:.1f} ms alone vs "
        f"{steady['decode_ms_during_train']:.1f} ms during a train step; sampler seconds: "
        + ", ".join(
            f"{c} {categories[f'{SAMPLER}/{c}']['seconds']:.1f}"
            for c in ("decode", "prefill", "compile", "idle")
            if f"{SAMPLER}/{c}" in categories
        ),
        flush=True,
    )


def report_async(results: dict) -> tuple[float, float]:
    """Table 3: sync against async per step and whole loops; returns (measured, ideal) speedup."""
    from composer_jax.trace import SAMPLER

    sync, asyn = results["sync"], results["async"]
    g, t = sync["wait_s"], sync["train_s"]
    ideal = ideal_speedup(g, t)
    speedup = sync["step_s"] / asyn["step_s"]
    print(
        _table(
            ["mode", "s/step", "train s/step", "wait s/step", "sampler busy (steps 2+)"],
            [
                [
                    n,
                    f"{r['step_s']:.2f}",
                    f"{r['train_s']:.2f}",
                    f"{r['wait_s']:.2f}",
                    f"{r['steady']['busy'][SAMPLER]:.1%}",
                ]
                for n, r in results.items()
            ],
        )
    )
    print(
        f"sync: generation g = {g:.2f} s, training t = {t:.2f} s per step; ideal (g + t) / "
        f"max(g, t) = {ideal:.2f}x; measured {speedup:.2f}x = {speedup / ideal:.0%} of ideal "
        "(target >= 90%)"
    )
    walls = {n: r["summary"]["wall_s"] for n, r in results.items()}
    whole = walls["sync"] / walls["async"]
    print(
        f"whole loops (step 1 and its compiles included; no head start for the async sampler): "
        f"sync {walls['sync']:.1f} s, async {walls['async']:.1f} s: {whole:.2f}x = "
        f"{whole / ideal:.0%} of ideal"
    )
    return speedup, ideal


def main(argv):
    del argv
    import shutil

    from absl import logging

    logging.set_verbosity(logging.WARNING)

    from composer_jax import agent
    from composer_jax.actor.setup import warm_start, warm_start_config
    from composer_jax.trace import SAMPLER
    from composer_jax.train.loop import run_pretraining

    base = experiment_config()
    rl = base.rl
    warm = FLAGS.warm_start
    if not warm:
        warm_cfg = warm_start_config(dataclasses.replace(base, workdir=FLAGS.out))
        warm = warm_cfg.workdir
        if not os.path.exists(os.path.join(warm, "checkpoints")):
            run_pretraining(warm_cfg, sft_examples=agent.sft_examples(warm_cfg))
    samples = rl.rollout.groups_per_step * rl.rollout.group_size

    print("\n== 1. Train step: RL vs pretraining, same model and batch ==", flush=True)
    train = train_step_rows(base, FLAGS.train_steps, FLAGS.prompt_len)
    report_train_steps(train, samples, rl)

    results = {}
    for name, staleness in (("sync", 0), ("async", FLAGS.max_staleness)):
        shutil.rmtree(os.path.join(FLAGS.out, name), ignore_errors=True)
        results[name] = loop_run(base, name, staleness, warm)

    print("\n== 2. Sampler: standalone vs inside the asynchronous actor loop ==", flush=True)
    model = warm_start(
        dataclasses.replace(base, rl=dataclasses.replace(rl, warm_start=warm)), False
    )
    alone, alone_tokens = sampler_rate(model, rl, FLAGS.prompt_len, 2 * samples)
    report_sampler(results, alone, alone_tokens, rl)

    print("\n== 3. Async vs sync against the ideal overlap ==")
    speedup, ideal = report_async(results)
    steady = results["async"]["steady"]
    loop_rate = steady["decoded_tokens"] / steady["wall_s"]
    pre_s = train[0][2]
    print(
        f"\nRatios: RL step {pre_s / train[4][2]:.0%} of pretraining tokens/s (target >= 60%; "
        f"{train[1][2] / train[4][2]:.0%} of CE only); "
        f"sampler in the loop {loop_rate / alone:.0%} of standalone; sampler busy "
        f"{steady['busy'][SAMPLER]:.0%} (>= 85%); async {speedup / ideal:.0%} of ideal (>= 90%)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    flags.DEFINE_integer("steps", 8, "RL steps per actor-loop run.")
    flags.DEFINE_string("warm_start", "", "A warm-start run (default: a short SFT here).")
    flags.DEFINE_integer("warm_start_steps", 30, "SFT steps of the default warm start.")
    flags.DEFINE_integer("groups_per_step", 2, "Groups per RL step.")
    flags.DEFINE_integer("group_size", 8, "Samples per group.")
    flags.DEFINE_integer("num_slots", 16, "Sampler slots.")
    flags.DEFINE_integer(
        "decode_chunk", 1, "Decode steps per engine call (rl.rollout.decode_chunk)."
    )
    flags.DEFINE_integer("max_new_tokens", 96, "Tokens per turn.")
    flags.DEFINE_integer("context_len", 768, "RL rows' length (the train-step shape).")
    flags.DEFINE_integer("prompt_len", 280, "Prompt tokens of the standalone sampler.")
    flags.DEFINE_integer("max_staleness", 2, "Bound of the asynchronous run.")
    flags.DEFINE_integer("train_steps", 3, "Timed steps of each standalone train step.")
    flags.DEFINE_string("out", "runs/bench_throughput", "Output folder.")
    flags.DEFINE_bool("multi_thread", False, "Let XLA use every core per computation.")
    if "--multi_thread" not in sys.argv:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
        ).strip()
    app.run(main)
