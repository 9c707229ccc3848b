"""A child of `launch.multiprocess` for tests/test_multiprocess.py.

exit STATUS              process 1 exits with STATUS, the others sleep (to be stopped)
batch CONFIG_PY OUT_DIR  joins the job, builds the first global batch of the config's first
                         phase and saves this process's device shards to OUT_DIR/<index>.npz
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
    corpora = loop._Corpora(cfg, resolve_tokenizer(cfg))
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


if __name__ == "__main__":
    {"exit": _exit, "batch": _batch}[sys.argv[1]](*sys.argv[2:])
