"""A child of `launch.multiprocess` for tests/test_multiprocess.py.

exit STATUS              process 1 exits with STATUS, the others sleep (to be stopped)
batch CONFIG_PY OUT_DIR  joins the job, builds the first global batch of the config's first
                         phase and saves this process's device shards to OUT_DIR/<index>.npz
channel                  a model sharded over both processes comes back whole on each
                         (`host_model`); then process 0 sends commands through a LeaderChannel
                         (a multi-chunk one, more than RETAINED of them) after waiting past
                         the 30 s a gloo rendezvous allows; the others print a digest of each
load CKPT OUT_DIR        loads an HF checkpoint sharded over both processes (fsdp=4 x cp=2):
                         each saves its device shards and the bytes it read to
                         OUT_DIR/<index>.npz; process 0 also the logits of the gathered model
export CKPT OUT_DIR      the same sharded load, then `export_hf_checkpoint` (fp8, small shards)
                         into OUT_DIR/export from both; each prints the shard files it wrote
rl_step OUT_DIR          one RL trainer step over both processes (process 1 follows process 0's
                         commands): process 0 samples a batch, saves it, the step's metrics and
                         the new parameters to OUT_DIR; both publish their weight shards
"""

import os
import sys
import time


def _exit(status: str) -> None:
    print(f"coordinator {os.environ['JAX_COORDINATOR_ADDRESS']}", flush=True)
    print(f"xla_flags {os.environ['XLA_FLAGS']}", flush=True)
    if os.environ["JAX_PROCESS_ID"] == "1":
        print("failing", file=sys.stderr, flush=True)
        sys.exit(int(status))
    time.sleep(120)


def _batch(config_py: str, out_dir: str) -> None:
    import importlib.util

    from absl import flags

    flags.FLAGS(["probe"])  # runtime.initialize reads --verbosity
    from launch import runtime

    runtime.initialize()
    import jax
    import numpy as np

    from composer_jax.train import loop
    from composer_jax.train.runs import resolve_tokenizer

    spec = importlib.util.spec_from_file_location("probe_config", config_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_experiment()
    layout = loop.make_train_setup(cfg).layout
    corpora = loop._Corpora(loop.open_corpus(cfg), resolve_tokenizer(cfg))
    batch = loop._global_batch(next(loop._make_iterator(cfg, corpora, 0)), layout)
    shards = {}
    for key, array in batch.items():
        for shard in array.addressable_shards:
            rows, cols = shard.index
            shards[f"{key}/{shard.device.id}"] = np.asarray(shard.data)
            shards[f"{key}/{shard.device.id}/index"] = np.array(
                [rows.start or 0, cols.start or 0], np.int64
            )
    np.savez(os.path.join(out_dir, f"{jax.process_index()}.npz"), **shards)


def _channel() -> None:
    import hashlib

    from absl import flags

    flags.FLAGS(["probe"])
    from launch import runtime

    runtime.initialize()
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from composer_jax.parallel.multihost import LeaderChannel, host_model, place_global

    kernel = np.random.default_rng(7).normal(size=(8, 6)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    model = nnx.Linear(8, 6, rngs=nnx.Rngs(0))
    model.kernel.set_value(place_global(kernel, NamedSharding(mesh, P("x"))))
    assert not model.kernel[...].is_fully_addressable
    local = host_model(model)
    assert local.kernel[...].is_fully_addressable
    np.testing.assert_array_equal(np.asarray(local.kernel[...]), kernel)
    print("host_model ok", flush=True)

    payloads = [np.random.default_rng(i).bytes(3_000_000 if i == 2 else 100 * i) for i in range(12)]
    channel = LeaderChannel("probe")
    if jax.process_index() == 0:
        time.sleep(35)  # longer than a gloo rendezvous would wait (30 s)
        for i, payload in enumerate(payloads):
            channel.send(f"c{i}", payload)
        left = channel._client.key_value_dir_get_bytes("probe/")
        print("commands held", sorted({key.split("/")[1] for key, _ in left}), flush=True)
    else:
        for _ in payloads:
            kind, payload = channel.receive()
            print(f"received {kind} {hashlib.sha256(payload).hexdigest()[:16]}", flush=True)


LOAD_TOKENS = [[3, 17, 99, 4, 250, 8, 61, 2]]


def _load(checkpoint: str, out_dir: str) -> None:
    from absl import flags

    flags.FLAGS(["probe"])
    from launch import runtime

    runtime.initialize()
    import jax
    import numpy as np
    from flax import nnx

    from composer_jax import model
    from composer_jax.config import MeshConfig
    from composer_jax.interop import hf, streaming
    from composer_jax.parallel import make_layout
    from composer_jax.parallel.multihost import host_model

    layout = make_layout(MeshConfig(fsdp=4, cp=2))
    with streaming.CheckpointReader(checkpoint) as reader:
        loaded = hf.load_from_reader(reader, layout=layout)
    out = {"bytes_read": np.int64(reader.bytes_read), "total_bytes": np.int64(reader.total_bytes)}
    flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(loaded)))
    for path, array in flat:
        for shard in array.addressable_shards:
            key = f"{jax.tree_util.keystr(path)}@{shard.device.id}"
            out[key] = np.asarray(shard.data)
            out[key + "@start"] = np.array([s.start or 0 for s in shard.index], np.int64)
    local = host_model(loaded)
    if jax.process_index() == 0:
        out["logits"] = np.asarray(model.compute_logits(local, np.array(LOAD_TOKENS)))
    np.savez(os.path.join(out_dir, f"{jax.process_index()}.npz"), **out)


def _export(checkpoint: str, out_dir: str) -> None:
    from absl import flags

    flags.FLAGS(["probe"])
    from launch import runtime

    runtime.initialize()
    from composer_jax import interop
    from composer_jax.config import MeshConfig
    from composer_jax.parallel import make_layout

    loaded = interop.load_hf_checkpoint(checkpoint, layout=make_layout(MeshConfig(fsdp=4, cp=2)))
    folder = os.path.join(out_dir, "export")
    written = interop.export_hf_checkpoint(loaded, folder, dtype="fp8", shard_bytes=64 << 10)
    print("wrote", " ".join(written), flush=True)


def rl_step_config(workdir: str):
    """rl_tiny in float32 (the comparison with one process is tight), its layout fitted to 8."""
    import dataclasses

    from composer_jax import presets

    cfg = presets.rl_tiny()
    model = dataclasses.replace(cfg.model, dtype="float32")
    return dataclasses.replace(cfg, model=model, workdir=workdir)


def rl_step_batch():
    """A real rollout batch of 8 rows from the untrained policy, one sample per group rewarded."""
    import dataclasses

    import numpy as np

    from composer_jax import agent
    from composer_jax.config import AgentConfig, RLObjectiveConfig
    from composer_jax.data import ByteTokenizer
    from composer_jax.envs import builtin_tasks
    from composer_jax.infer import InferenceEngine, SamplingParams
    from composer_jax.model import init_model

    model = init_model(rl_step_config("unused").model, 0)
    engine = InferenceEngine(model, num_slots=4, max_len=384, prefill_buckets=(384,))
    tasks = builtin_tasks(2, "train", seed=0, max_ops=1)
    workflow, env = agent.build(
        AgentConfig(max_turns=1),
        ByteTokenizer(),
        model.cfg,
        max_len=384,
        sampling=SamplingParams(max_new_tokens=16, seed=1),
        distill=RLObjectiveConfig().distill_coef > 0,
    )
    batch, _ = agent.collect_batch(engine, tasks, 2, workflow, env, seq_len=384, num_rows=8)
    return dataclasses.replace(batch, rewards_N={"task": np.array([1, 0, 0, 1], np.float32)})


def _rl_step(out_dir: str) -> None:
    import json
    import pickle

    from absl import flags

    flags.FLAGS(["probe"])
    from launch import runtime

    runtime.initialize()
    import jax
    import numpy as np

    from composer_jax.actor.trainer import RLTrainer
    from composer_jax.model import init_model
    from composer_jax.parallel.multihost import LeaderChannel
    from composer_jax.train.loop import StopRequest
    from composer_jax.train.step import split_model

    cfg = rl_step_config(os.path.join(out_dir, "run"))
    _, params, buffers = split_model(init_model(cfg.model, 0))
    params, buffers = jax.tree.map(np.asarray, (params, buffers))  # the same on every process
    channel = LeaderChannel("probe_trainer")
    trainer = RLTrainer(cfg, params, buffers, os.path.join(out_dir, "weights"), channel=channel)
    if jax.process_index() != 0:
        with StopRequest() as stop:
            trainer.follow(stop)
        return
    batch = rl_step_batch()
    trainer.publish().result()
    metrics = trainer.step(batch)
    trainer.last_publish.result()
    final = trainer.host_model()
    trainer.close()
    with open(os.path.join(out_dir, "batch.pkl"), "wb") as f:
        pickle.dump(batch, f)
    with open(os.path.join(out_dir, "metrics.json"), "w") as f:
        json.dump(metrics, f)
    _, final_params, _ = split_model(final)
    leaves = jax.tree.leaves(final_params)
    np.savez(os.path.join(out_dir, "params.npz"), *[np.asarray(x) for x in leaves])


if __name__ == "__main__":
    {
        "exit": _exit,
        "batch": _batch,
        "channel": _channel,
        "load": _load,
        "export": _export,
        "rl_step": _rl_step,
    }[sys.argv[1]](*sys.argv[2:])
