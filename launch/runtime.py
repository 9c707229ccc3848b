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
    _show_project_logs()
    import jax

    if os.environ.get("COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            os.environ["COORDINATOR_ADDRESS"],
            int(os.environ["NUM_PROCESSES"]),
            int(os.environ["PROCESS_ID"]),
        )
    elif os.environ.get("SLURM_NTASKS", "1") != "1" or os.environ.get("OMPI_COMM_WORLD_SIZE"):
        jax.distributed.initialize()


def _show_project_logs() -> None:
    """The project's own INFO lines (warm start, held-out rewards, resumes) on stdout as plain
    text, whatever the libraries' verbosity."""
    import logging as std_logging
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
