"""Process start-up shared by every entry point: log level and multi-host initialisation."""

import os

from absl import flags, logging


def initialize() -> None:
    """Quiets library INFO logs (unless --verbosity is given) and joins a multi-host job.

    `jax.distributed.initialize()` auto-detects SLURM and Open MPI; for other clusters set
    COORDINATOR_ADDRESS, NUM_PROCESSES and PROCESS_ID.
    """
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO.
    import jax

    if os.environ.get("COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            os.environ["COORDINATOR_ADDRESS"],
            int(os.environ["NUM_PROCESSES"]),
            int(os.environ["PROCESS_ID"]),
        )
    elif os.environ.get("SLURM_NTASKS", "1") != "1" or os.environ.get("OMPI_COMM_WORLD_SIZE"):
        jax.distributed.initialize()


def initialize_ray() -> None:
    """Joins the Ray cluster named by RAY_ADDRESS (e.g. `ray start --head` on the head host), or
    starts a local one; rollout workers then spread over its hosts."""
    try:
        import ray
    except ImportError:
        raise SystemExit("--config.rl.backend=ray needs Ray: pip install 'composer-jax[ray]'")
    if not ray.is_initialized():
        ray.init(
            address=os.environ.get("RAY_ADDRESS") or None,
            include_dashboard=False,
            log_to_driver=True,
        )
