r"""Writes a cluster launcher for an entry point: an sbatch script, a JobSet manifest or a
Dockerfile, with the GPU kind's XLA settings (launch/cluster/presets.py).

  python -m launch.cluster.render --kind=slurm --nodes=2 --gpus_per_node=8 --gpu=h200 \
      -- launch.pretrain --config=small --config.workdir=runs/small_2x8
  python -m launch.cluster.render --kind=jobset --nodes=2 --gpu=b200 --image=REGISTRY/composer-jax \
      --pvc=runs --env=NCCL_SOCKET_IFNAME=eth0 -- launch.pretrain --config.workdir=/runs/small
  python -m launch.cluster.render --kind=docker --gpu=h100 -- launch.pretrain --config=small

Everything after `--` is the command every host runs (`python -m MODULE ARGS`); the module must
exist here. Files go to `--out` (default runs/jobs); the last line printed says how to submit.
"""

from __future__ import annotations

import os
import sys

from absl import flags

from launch.cluster import presets, templates


def _define_flags():
    return dict(
        kind=flags.DEFINE_string("kind", None, f"One of {', '.join(templates.KINDS)}."),
        gpu=flags.DEFINE_string("gpu", None, f"GPU kind: {', '.join(presets.GPU_KINDS)}."),
        nodes=flags.DEFINE_integer("nodes", 1, "Hosts (one process each)."),
        gpus_per_node=flags.DEFINE_integer("gpus_per_node", 8, "GPUs each process drives."),
        name=flags.DEFINE_string("name", "", "Job name (default: the module's last part)."),
        out=flags.DEFINE_string("out", os.path.join("runs", "jobs"), "Folder of the files."),
        env=flags.DEFINE_multi_string("env", [], "KEY=VALUE exported on every host (repeat)."),
        # SLURM
        time=flags.DEFINE_string("time", "", "slurm: time limit (SIGTERM 5 min before it)."),
        sbatch=flags.DEFINE_multi_string("sbatch", [], "slurm: extra option KEY=VALUE (repeat)."),
        venv=flags.DEFINE_string("venv", ".venv", "slurm: virtualenv to activate ('' for none)."),
        setup=flags.DEFINE_multi_string("setup", [], "slurm: shell line run before srun."),
        cpus_per_node=flags.DEFINE_integer(
            "cpus_per_node", 0, "slurm: CPUs per task (0: SLURM's)."
        ),
        chdir=flags.DEFINE_string("chdir", templates.REPO, "slurm: the checkout on the cluster."),
        # Kubernetes
        image=flags.DEFINE_string("image", "composer-jax:latest", "jobset: container image."),
        port=flags.DEFINE_integer("port", 8476, "jobset: jax.distributed coordinator port."),
        pvc=flags.DEFINE_string("pvc", "", "jobset: ReadWriteMany claim for the workdirs."),
        mount=flags.DEFINE_string("mount", "/runs", "jobset: where the claim is mounted."),
        max_restarts=flags.DEFINE_integer("max_restarts", 3, "jobset: whole-job restarts."),
        # Docker
        base_image=flags.DEFINE_string(
            "base_image", "nvidia/cuda:12.8.1-base-ubuntu24.04", "docker: CUDA 12 base image."
        ),
    )


def _options(kind: str, values: dict, out: str) -> dict:
    """The kind's own keyword arguments of `templates.render`."""
    if kind == "slurm":
        return dict(
            log_dir=os.path.abspath(out),
            chdir=values["chdir"],
            venv=values["venv"],
            setup=tuple(values["setup"]),
            sbatch=tuple(values["sbatch"]),
            time=values["time"],
            cpus_per_node=values["cpus_per_node"],
        )
    if kind == "jobset":
        keys = ("image", "port", "pvc", "mount", "max_restarts")
        return {k: values[k] for k in keys}
    return dict(base_image=values["base_image"])


_SUBMIT = {
    "slurm": "sbatch {path}",
    "jobset": "kubectl apply -f {path}",
    "docker": "docker build -f {path} -t IMAGE .   (from the repository root)",
}


def main(flag_holders: dict, command: list[str]) -> int:
    values = {k: h.value for k, h in flag_holders.items()}
    try:
        if values["kind"] not in templates.KINDS:
            raise ValueError(f"--kind={values['kind'] or ''}: one of {', '.join(templates.KINDS)}")
        if values["gpu"] is None:
            raise ValueError(f"--gpu is required: one of {', '.join(presets.GPU_KINDS)}")
        extra = []
        for item in values["env"]:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--env={item}: expected KEY=VALUE")
            extra.append((key, value))
        module = command[0] if command else ""
        name = values["name"] or module.rsplit(".", 1)[-1].replace("_", "-")
        job = templates.Job(
            name=name,
            nodes=values["nodes"],
            gpus_per_node=values["gpus_per_node"],
            gpu=values["gpu"],
            command=tuple(command),
            env=tuple(extra),
        )
        files = templates.render(
            values["kind"], job, **_options(values["kind"], values, values["out"])
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    os.makedirs(values["out"], exist_ok=True)
    for file_name, text in files.items():
        path = os.path.join(values["out"], file_name)
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {path}")
    print("submit: " + _SUBMIT[values["kind"]].format(path=path))
    return 0


if __name__ == "__main__":
    from launch import cli

    # The command after `--` is the job's, kept away from this program's flag parsing (which
    # would rewrite its --config).
    split = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
    sys.argv, _COMMAND = sys.argv[:split], sys.argv[split + 1 :]
    _FLAGS = _define_flags()
    cli.run(lambda argv: sys.exit(main(_FLAGS, _COMMAND)))
