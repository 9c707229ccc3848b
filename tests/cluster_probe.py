"""Stands in for an entry point in the cluster-launcher tests: joins the job the way every entry
point does (`launch.runtime.initialize`) and prints what `jax.distributed` made of it."""

import json
import sys

from absl import app


def main(argv):
    from launch import runtime

    runtime.initialize()
    import jax

    report = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_device_ids": jax.config.values["jax_cuda_visible_devices"],
        "argv": argv[1:],
    }
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    app.run(main, argv=[sys.argv[0]] + ["--"] + sys.argv[1:])
