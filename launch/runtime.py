"""Process start-up shared by every entry point: log level and multi-host initialisation.

A multi-host job is one process per host, each driving all of that host's GPUs, joined by
`jax.distributed` in `initialize`: from JAX's own cluster detection (SLURM, Open MPI,
Kubernetes, ...) or from `EXPLICIT_VARIABLES`, which JobSet manifests (`launch.cluster`) and
`launch.multiprocess` set. The mesh's `-1` axis then spans every process's devices; what the
processes exchange besides collectives is `composer_jax.parallel.multihost`. Rollouts across
hosts use Ray instead: `initialize_ray` joins (or starts) its cluster.
"""

import faulthandler
import logging as std_logging
import os
import signal

from absl import flags, logging

# The explicit way to join a job where JAX detects no cluster (what `launch.multiprocess` sets):
# JAX itself reads JAX_COORDINATOR_ADDRESS; the count and the index have no JAX variable.
EXPLICIT_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize() -> None:
    """Quiets library INFO logs (unless --verbosity is given), joins a multi-process job when the
    environment describes one, and logs this process's place in it. `kill -USR1 PID` then prints
    every thread's Python stack to stderr: the first question about a job that stopped making
    progress (a collective one process never joined, a save that never ended)."""
    if hasattr(signal, "SIGUSR1"):  # not on Windows
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
    _show_project_logs()
    import jax

    arguments = distributed_arguments()
    if arguments is not None and not jax.distributed.is_initialized():
        # Cross-process collectives on CPU (tests, laptops); GPUs and TPUs use their own.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(**arguments)
    local = jax.local_devices()
    std_logging.getLogger("composer_jax.runtime").info(
        "process %d of %d, %d local device(s) of %d: %s",
        jax.process_index(),
        jax.process_count(),
        len(local),
        jax.device_count(),
        ", ".join(f"{d.platform}:{d.id}" for d in local),
    )


def distributed_arguments() -> dict | None:
    """Arguments for `jax.distributed.initialize`, or None outside a multi-process job.

    The explicit variables (all three) win; otherwise JAX's own cluster detection decides (its
    `ClusterEnv`s: SLURM, Open MPI, Kubernetes, Cloud TPU, ...; opt-in ones such as mpi4py only
    when asked), and `initialize()` then fills in everything itself.
    """
    given = {name: os.environ.get(name) for name in EXPLICIT_VARIABLES}
    if any(given.values()):
        missing = [name for name, value in given.items() if not value]
        if missing:
            raise SystemExit(
                f"error: {', '.join(n for n, v in given.items() if v)} set but not "
                f"{', '.join(missing)}: a multi-process start needs all of {EXPLICIT_VARIABLES}"
            )
        try:
            return {
                "coordinator_address": given["JAX_COORDINATOR_ADDRESS"],
                "num_processes": int(given["JAX_NUM_PROCESSES"]),
                "process_id": int(given["JAX_PROCESS_ID"]),
            }
        except ValueError:
            raise SystemExit(
                f"error: JAX_NUM_PROCESSES={given['JAX_NUM_PROCESSES']!r} and "
                f"JAX_PROCESS_ID={given['JAX_PROCESS_ID']!r} must be integers"
            ) from None
    from jax._src import clusters

    detected = [
        env
        for env in clusters.ClusterEnv._cluster_types
        if not env.opt_in_only_method and env.is_env_present()
    ]
    return {} if detected else None


def _show_project_logs() -> None:
    """The project's own INFO lines (warm start, held-out rewards, resumes) on stdout as plain
    text, whatever the libraries' verbosity."""
    import sys

    project = std_logging.getLogger("composer_jax")
    if any(getattr(h, "composer_jax", False) for h in project.handlers):
        return

    class Plain(std_logging.Formatter):
        def format(self, record):
            text = super().format(record)
            return f"{record.levelname.lower()}: {text}" if record.levelno > 20 else text

    handler = std_logging.StreamHandler(sys.stdout)
    handler.setFormatter(Plain("%(message)s"))
    handler.composer_jax = True
    project.addHandler(handler)
    project.setLevel(std_logging.INFO)
    project.propagate = False


# Left out of the project that Ray ships to its workers (gitignore patterns, from the root).
RAY_EXCLUDES = (
    ".git",
    "/.venv/",
    "/.cache/",
    "/runs/",
    "/workdir/",
    "__pycache__/",
    "*.egg-info/",
    "build/",
)


def ray_runtime_env() -> dict:
    """Ships this checkout (minus runs and environments) as every Ray worker's working
    directory, so the cluster's hosts need the dependencies only and run this very code."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {"working_dir": root, "excludes": list(RAY_EXCLUDES)}


def initialize_ray() -> None:
    """Joins the Ray cluster named by RAY_ADDRESS (e.g. `ray start --head` on the head host), or
    starts a local one (not joining another cluster that runs on this machine), with the project
    as the job's runtime_env; rollout workers then spread over its hosts."""
    try:
        import ray
    except ImportError:
        raise SystemExit(
            "--config.rl.rollout.backend=ray needs Ray: pip install 'composer-jax[ray]'"
        )
    if not ray.is_initialized():
        ray.init(
            address=os.environ.get("RAY_ADDRESS") or "local",
            include_dashboard=False,
            log_to_driver=True,
            runtime_env=ray_runtime_env(),
        )
