"""Small cases of the GPU check: device probe, the GPU-marked tests, ragged all-to-all."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

from composer_jax.plan import devices


def probe(params: dict, ctx: dict) -> dict:
    """What this machine is: JAX version, platform, device kind, memory, the spec we matched."""
    import jax

    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    spec = devices.spec_for(device.device_kind)
    return {
        "status": "ok",
        "jax": jax.__version__,
        "platform": jax.default_backend(),
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "bytes_limit": stats.get("bytes_limit"),
        "spec": spec.name if spec else None,
    }


def pytest_gpu(params: dict, ctx: dict) -> dict:
    """`pytest -m gpu` over the kernel tests: compiled on a GPU, interpreted on CPU."""
    env = dict(os.environ)
    if not ctx["dry_run"]:
        env.pop("JAX_PLATFORMS", None)  # tests/conftest.py defaults to CPU otherwise
        env["JAX_PLATFORMS"] = "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "junit.xml")
        # The repository's addopts name plugins (xdist) the lent image may lack: none here.
        cmd = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider"]
        cmd += ["-m", "gpu", f"--junitxml={report}"]
        cmd += params.get("paths", ["tests/kernels"])
        cmd += params.get("select", [])
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=params["limit_s"]
        )
        tests = []
        if os.path.exists(report):
            for case in ET.parse(report).getroot().iter("testcase"):
                outcome = "passed"
                for child in case:
                    if child.tag in ("failure", "error"):
                        outcome = "failed"
                    elif child.tag == "skipped":
                        outcome = "skipped"
                tests.append((f"{case.get('classname')}::{case.get('name')}", outcome))
    failed = [name for name, outcome in tests if outcome == "failed"]
    ok = proc.returncode == 0 and tests and not failed
    return {
        "status": "ok" if ok else "fail",
        "tests": tests,
        "failed": failed,
        "output_tail": (proc.stdout + proc.stderr)[-1500:] if not ok else "",
    }


def ragged_all_to_all(params: dict, ctx: dict) -> dict:
    """`lax.ragged_all_to_all` over every local device against its definition."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    if jax.default_backend() == "cpu":
        return {"status": "n/a", "reason": "ragged_all_to_all has no XLA:CPU implementation"}
    n = jax.device_count()
    rows, width = params["rows"], params["width"]
    rng = np.random.default_rng(0)
    # send[i, j]: rows device i sends to device j, a prefix of each device's buffer in order j.
    send = rng.integers(0, rows // (2 * n) + 1, (n, n)).astype(np.int32)
    data = rng.standard_normal((n, rows, width)).astype(np.float32)
    in_off = np.cumsum(send, 1) - send
    recv = send.T  # recv[j, i] = send[i, j]
    out_off_at_dest = (np.cumsum(recv, 1) - recv).T  # where i's rows land on j
    mesh = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    def exchange(x, out, in_offsets, send_sizes, out_offsets, recv_sizes):
        return jax.lax.ragged_all_to_all(
            x[0], out[0], in_offsets[0], send_sizes[0], out_offsets[0], recv_sizes[0],
            axis_name="d",
        )[None]  # fmt: skip

    got = np.asarray(
        exchange(
            jnp.asarray(data),
            jnp.zeros_like(jnp.asarray(data)),
            jnp.asarray(in_off),
            jnp.asarray(send),
            jnp.asarray(out_off_at_dest),
            jnp.asarray(recv),
        )
    )
    want = np.zeros_like(data)
    for j in range(n):
        for i in range(n):
            start = out_off_at_dest[i, j]
            want[j, start : start + send[i, j]] = data[i, in_off[i, j] : in_off[i, j] + send[i, j]]
    ok = np.array_equal(got, want)
    return {"status": "ok" if ok else "fail", "devices": n}
