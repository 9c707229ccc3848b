"""The text of a cluster job: one process per host, each driving all of its host's GPUs, joined
by `jax.distributed` (launch/runtime.py calls `initialize()`).

  slurm   an sbatch script: `srun` starts one task per node; JAX reads the SLURM_* variables,
          JAX_LOCAL_DEVICE_IDS makes each task take all its GPUs (JAX's SLURM detection would
          otherwise give task `i` of a node only GPU `i`, assuming one task per GPU)
  jobset  a Kubernetes JobSet (one indexed Job, a pod per node) and the headless Service its
          pods resolve each other by; the coordinator is pod 0, named by JAX_COORDINATOR_ADDRESS,
          JAX_NUM_PROCESSES and JAX_PROCESS_ID (the job-completion index), which
          `runtime.initialize` reads: JAX's own Kubernetes detection would need the
          `kubernetes` package and RBAC to read pods
  docker  a Dockerfile: CUDA 12 base, `pip install .[cuda12]`, the GPU kind's settings baked in
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shlex

import yaml

from launch.cluster import presets

KINDS = ("slurm", "jobset", "docker")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class Job:
    """What every launcher needs; `command` is `MODULE ARGS...` (run as `python -m`)."""

    name: str
    nodes: int
    gpus_per_node: int
    gpu: str
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # cluster-specific extras (NCCL_SOCKET_IFNAME, ...)

    def __post_init__(self):
        if not self.command:
            raise ValueError("no command: give MODULE ARGS after '--', e.g. launch.pretrain")
        module = self.command[0]
        if module in ("python", "python3", "-m") or module.endswith(".py"):
            raise ValueError(f"{module!r}: give a module name (e.g. launch.pretrain), not python")
        if not _module_exists(module):
            raise ValueError(f"no module {module!r} here (run from the repository root)")
        if not _NAME.fullmatch(self.name):
            raise ValueError(
                f"job name {self.name!r}: lowercase letters, digits and '-', starting with a "
                "letter, at most 40 characters (it becomes Kubernetes host names)"
            )
        if self.nodes < 1:
            raise ValueError(f"nodes must be at least 1, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be at least 1, got {self.gpus_per_node}")
        presets.settings(self.gpu)  # an unknown kind fails here
        for key, _ in self.env:
            if not _ENV_NAME.fullmatch(key):
                raise ValueError(f"environment variable name {key!r} is not valid")

    def environment(self) -> dict[str, str]:
        """The GPU kind's preset, then the extras (which win)."""
        return {**presets.environment(self.gpu), **dict(self.env)}

    def argv(self) -> list[str]:
        return ["python", "-m", *self.command]


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package, or a malformed name
        return False


def render(kind: str, job: Job, **options) -> dict[str, str]:
    """{file name: text} of the launcher `kind` for `job`; options are the kind's own."""
    renderers = {"slurm": slurm, "jobset": jobset, "docker": dockerfile}
    if kind not in renderers:
        raise ValueError(f"unknown launcher kind {kind!r}; one of {', '.join(KINDS)}")
    return renderers[kind](job, **options)


def _comments(job: Job) -> list[str]:
    return [f"# {line}" for line in presets.reasons(job.gpu)]


# ----------------------------------------------------------------------------- SLURM


def slurm(
    job: Job,
    log_dir: str,
    chdir: str = REPO,
    venv: str = ".venv",
    setup: tuple[str, ...] = (),
    sbatch: tuple[str, ...] = (),
    time: str = "",
    cpus_per_node: int = 0,
) -> dict[str, str]:
    """An sbatch script; `sbatch` adds `#SBATCH --KEY=VALUE` options (account, partition, qos)."""
    options = {
        "job-name": job.name,
        "nodes": job.nodes,
        "ntasks-per-node": 1,
        "gpus-per-task": job.gpus_per_node,
        "exclusive": None,
        "chdir": chdir,
        "output": os.path.join(log_dir, f"{job.name}-%j.out"),
    }
    if cpus_per_node:
        options["cpus-per-task"] = cpus_per_node
    if time:
        options["time"] = time
        # The loop stops at a step boundary on SIGTERM and saves: ask for it 5 minutes early.
        options["signal"] = "TERM@300"
    for option in sbatch:
        key, _, value = option.partition("=")
        options[key.lstrip("-")] = value or None
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH --{k}" + ("" if v is None else f"={v}") for k, v in options.items()]
    lines += [
        f"# {job.nodes} host(s) x {job.gpus_per_node} {job.gpu.upper()}: one task per host, "
        "joined by jax.distributed (JAX reads the SLURM_* variables).",
        "# Written by python -m launch.cluster.render; submit with sbatch.",
        "set -euo pipefail",
    ]
    if venv:
        lines.append(f"source {shlex.quote(os.path.join(venv, 'bin', 'activate'))}")
    lines += list(setup)
    lines += _comments(job)
    env = job.environment()
    env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(i) for i in range(job.gpus_per_node))
    lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines += [
        "# --kill-on-bad-exit: a failed task ends the others instead of leaving them waiting in",
        "# a collective; the entry point resumes the workdir when the job is submitted again.",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {shlex.join(job.argv())}",
    ]
    return {f"{job.name}.sbatch": "\n".join(lines) + "\n"}


# ----------------------------------------------------------------------------- Kubernetes


def jobset(
    job: Job,
    image: str,
    port: int = 8476,
    pvc: str = "",
    mount: str = "/runs",
    max_restarts: int = 3,
) -> dict[str, str]:
    """A headless Service and a JobSet; `pvc` mounts a ReadWriteMany claim at `mount`, where the
    workdir of a run on several pods must be unless it is a `gs://` bucket."""
    if not 0 < port < 65536:
        raise ValueError(f"port must be in 1..65535, got {port}")
    if job.nodes > 1:
        _check_shared_workdir(job, pvc, mount)
    worker = "workers"
    coordinator = f"{job.name}-{worker}-0-0.{job.name}:{port}"  # JobSet's pod host names
    selector = {"jobset.sigs.k8s.io/jobset-name": job.name}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": job.name},
        # Headless: DNS gives each pod's own address; published before readiness so that
        # process 0 is reachable while every process is still starting.
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector},
    }
    pod = _pod(job, image, port, coordinator, pvc, mount)
    job_spec = {
        "parallelism": job.nodes,
        "completions": job.nodes,
        "completionMode": "Indexed",
        # One failed process fails the Job at once (jax.distributed cannot take a process
        # back); the JobSet then restarts every pod and the run resumes from its checkpoint.
        "backoffLimit": 0,
        "template": {"spec": pod},
    }
    jobset_doc = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": job.name},
        "spec": {
            "failurePolicy": {"maxRestarts": max_restarts},
            "network": {"enableDNSHostnames": True, "subdomain": job.name},
            "replicatedJobs": [{"name": worker, "replicas": 1, "template": {"spec": job_spec}}],
        },
    }
    header = [
        f"# {job.nodes} pod(s) x {job.gpus_per_node} {job.gpu.upper()}, one per node, joined by "
        f"jax.distributed through {coordinator}.",
        "# Written by python -m launch.cluster.render; submit with kubectl apply -f (needs the",
        "# JobSet controller).",
        *_comments(job),
    ]
    body = yaml.safe_dump_all([service, jobset_doc], sort_keys=False, width=100)
    return {f"{job.name}.jobset.yaml": "\n".join(header) + "\n" + body}


def _pod(job: Job, image: str, port: int, coordinator: str, pvc: str, mount: str) -> dict:
    """The pod every process runs in: its environment (jax.distributed's coordinator, process
    count and index), /dev/shm, and the claim holding the workdir when `pvc` is set."""
    env = [{"name": k, "value": v} for k, v in job.environment().items()]
    env += [
        {"name": "JAX_COORDINATOR_ADDRESS", "value": coordinator},
        {"name": "JAX_NUM_PROCESSES", "value": str(job.nodes)},
        {
            "name": "JAX_PROCESS_ID",
            "valueFrom": {
                "fieldRef": {
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
                }
            },
        },
    ]
    # NCCL exchanges data through /dev/shm, which a container caps at 64 MiB by default.
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if pvc:
        mounts.append({"name": "runs", "mountPath": mount})
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": pvc}})
    container = {
        "name": "train",
        "image": image,
        "command": job.argv(),
        "env": env,
        "ports": [{"containerPort": port, "name": "coordinator"}],
        "resources": {"limits": {"nvidia.com/gpu": job.gpus_per_node}},
        "volumeMounts": mounts,
    }
    return {"restartPolicy": "Never", "containers": [container], "volumes": volumes}


def _check_shared_workdir(job: Job, pvc: str, mount: str) -> None:
    """Every process reads the workdir's config and writes its shards of each checkpoint there,
    so on several pods it must be one folder for all: a `gs://` bucket, or a path on the mounted
    claim, never a pod's own disk."""
    workdirs = [a.split("=", 1)[1] for a in job.command if a.startswith("--config.workdir=")]
    if workdirs and workdirs[-1].startswith("gs://"):
        return
    if not pvc:
        raise ValueError(
            f"{job.nodes} pods need a shared workdir: give --pvc (a ReadWriteMany claim) or a "
            "gs:// --config.workdir"
        )
    if not workdirs or not workdirs[-1].startswith(mount.rstrip("/") + "/"):
        given = f"--config.workdir={workdirs[-1]}" if workdirs else "the config's workdir"
        raise ValueError(f"{given} is not on the shared claim: use a path under {mount}")


# ----------------------------------------------------------------------------- Docker


def dockerfile(job: Job, base_image: str = "nvidia/cuda:12.8.1-base-ubuntu24.04") -> dict[str, str]:
    """A Dockerfile to build from the repository root (`docker build -f OUT/Dockerfile .`)."""
    env = " \\\n    ".join(f"{k}={json.dumps(v)}" for k, v in job.environment().items())
    lines = [
        "# Written by python -m launch.cluster.render. Build from the repository root:",
        f"#   docker build -f <this file> -t {job.name} .",
        "# The `base` flavour is enough: jax[cuda12] installs CUDA, cuDNN and NCCL as wheels, and",
        "# the driver comes from the host (NVIDIA container toolkit).",
        f"FROM {base_image}",
        "ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1",
        "# python3.12 is Ubuntu 24.04's own; git lets runs record their commit; bubblewrap is the",
        "# RL sandbox.",
        "RUN apt-get update && apt-get install -y --no-install-recommends \\",
        "        python3.12 python3.12-venv git bubblewrap ca-certificates \\",
        "    && rm -rf /var/lib/apt/lists/*",
        "RUN python3.12 -m venv /opt/venv",
        "ENV PATH=/opt/venv/bin:$PATH",
        "WORKDIR /workspace/composer-jax",
        "COPY . .",
        'RUN pip install ".[cuda12]"',
        *_comments(job),
        f"ENV {env}",
        f"CMD {json.dumps(job.argv())}",
    ]
    return {"Dockerfile": "\n".join(lines) + "\n"}
