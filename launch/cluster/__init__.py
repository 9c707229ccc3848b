"""Cluster launchers: SLURM and Kubernetes JobSet jobs, a CUDA 12 Dockerfile, and the XLA / NCCL
settings per GPU kind that every one of them exports (`python -m launch.cluster.render`)."""
