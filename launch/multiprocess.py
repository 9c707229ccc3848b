r"""Runs an entry point as N local processes of one `jax.distributed` job on CPU.

  python -m launch.multiprocess --num_processes=2 --devices_per_process=4 -- \
      launch.pretrain --config.steps=3 --config.workdir=runs/mp

Each process is `python -m MODULE ARGS...` with D simulated host devices, told where the
coordinator is (127.0.0.1, a free port) and which process it is through `runtime.EXPLICIT_VARIABLES`;
`runtime.initialize` joins the job. Output comes back line by line prefixed `[i]`. If one process
fails, the others are stopped and this exits with the failure's status. For tests and laptops: on
a cluster the same modules run under the cluster's launcher, which JAX detects by itself.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

from launch import runtime

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Processes to start.")
_DEVICES = flags.DEFINE_integer("devices_per_process", 1, "Simulated CPU devices per process.")
_GRACE_S = flags.DEFINE_float(
    "grace_s", 10.0, "Seconds a process gets to stop after SIGTERM before it is killed."
)

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the coordinator binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_environment(
    base: dict[str, str], index: int, count: int, devices: int, port: int
) -> dict[str, str]:
    """Process `index`'s environment: CPU only, `devices` host devices, the job's coordinates."""
    xla_flags = _DEVICE_COUNT_FLAG.sub("", base.get("XLA_FLAGS", "")).split()
    address, processes, process_id = runtime.EXPLICIT_VARIABLES
    return {
        **base,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join([*xla_flags, f"--xla_force_host_platform_device_count={devices}"]),
        address: f"127.0.0.1:{port}",
        processes: str(count),
        process_id: str(index),
    }


def _forward(stream, out, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()
    stream.close()


def run_processes(command: list[str], count: int, devices: int, grace_s: float = 10.0) -> int:
    """Starts `count` processes of `command` in one job; their exit status (the first failure's)."""
    port = free_port()
    procs, threads = [], []
    for index in range(count):
        proc = subprocess.Popen(
            command,
            env=process_environment(dict(os.environ), index, count, devices, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,  # a terminal's Ctrl-C reaches them once: forwarded from here
        )
        procs.append(proc)
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            thread = threading.Thread(target=_forward, args=(stream, out, f"[{index}] "))
            thread.start()
            threads.append(thread)

    def stop_all(signum=None, frame=None):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum or signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop_all) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        status = 0
        while status == 0 and any(proc.poll() is None for proc in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed:
                status = failed[0].returncode
                index = procs.index(failed[0])
                print(
                    f"process {index} failed (status {status}); stopping the others",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(0.1)
        status = status or next((p.returncode for p in procs if p.returncode != 0), 0)
        stop_all()
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for thread in threads:
            thread.join()
    return 128 - status if status < 0 else status  # killed by signal s: the shell's 128 + s


def main(argv):
    command = argv[1:]
    if not command:
        sys.exit("error: name the module to run after '--' (e.g. -- launch.pretrain ...)")
    if _NUM_PROCESSES.value < 1 or _DEVICES.value < 1:
        sys.exit(
            f"error: --num_processes ({_NUM_PROCESSES.value}) and --devices_per_process "
            f"({_DEVICES.value}) must be positive"
        )
    sys.exit(
        run_processes(
            [sys.executable, "-m", *command], _NUM_PROCESSES.value, _DEVICES.value, _GRACE_S.value
        )
    )


if __name__ == "__main__":
    app.run(main)
