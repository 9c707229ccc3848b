"""Cluster launchers rendered for 2 hosts x 8 GPUs and checked here, without a cluster: the XLA
flags of every preset are ones this XLA accepts, the sbatch script is valid bash whose `srun`
(stubbed: two local tasks with SLURM's variables) forms a 2-process jax.distributed job in which
each task takes all 8 GPUs, the JobSet manifest parses and its environment forms the same job
through launch/runtime.py, the Dockerfile installs the `cuda12` extra, and bad input ends the
renderer with one line."""

import configparser
import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys

import pytest
import yaml

from launch.cluster import presets, templates

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = ("launch.pretrain", "--config=tiny", "--config.workdir=/runs/tiny_2x8")
# Stands in for launch.pretrain: reports what jax.distributed made of the job.
PROBE = ("tests.cluster_probe", *PRETRAIN[1:])


def job(command=PRETRAIN, **kw):
    fields = dict(name="tiny-2x8", nodes=2, gpus_per_node=8, gpu="h200", command=command)
    return templates.Job(**{**fields, **kw})


def cpu_env(**extra):
    """The test session's environment for a child JAX process: CPU only, one device."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "SLURM_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO, **extra)
    return env


def free_port(low=1024, high=65535) -> int:
    for port in range(low, high + 1):
        with socket.socket() as s:
            try:
                s.bind(("localhost", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def start_jax(xla_flags: str) -> subprocess.CompletedProcess:
    code = "import jax; jax.devices()"
    return subprocess.run(
        [sys.executable, "-c", code],
        env=cpu_env(XLA_FLAGS=xla_flags),
        capture_output=True,
        text=True,
        timeout=120,
    )


# ----------------------------------------------------------------------------- presets


def test_xla_accepts_every_flag_of_every_preset_and_aborts_on_an_unknown_one():
    flags = sorted({f for gpu in presets.GPU_KINDS for f in presets.xla_flags(gpu).split()})
    assert start_jax(" ".join(flags)).returncode == 0
    bad = start_jax("--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_no_such_flag=1")
    assert bad.returncode != 0 and "xla_gpu_no_such_flag" in bad.stderr


def test_presets_give_a_reason_for_every_setting_and_differ_where_the_chips_do():
    for gpu in presets.GPU_KINDS:
        assert all(len(s.reason) > 20 for s in presets.settings(gpu))
    assert presets.environment("h100")["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in presets.environment("b200")
    assert "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL" in presets.xla_flags("b200")
    assert presets.environment("h200") == presets.environment("h100")
    with pytest.raises(ValueError, match="unknown GPU kind 'a100'; one of b200, h100, h200"):
        presets.settings("a100")


# ----------------------------------------------------------------------------- SLURM

STUB_SRUN = r"""#!/bin/bash
# srun on one machine: STUB_NTASKS copies of the command with SLURM's per-task variables.
while [[ $1 == --* ]]; do shift; done
pids=()
for ((i = 0; i < STUB_NTASKS; i++)); do
    SLURM_JOB_ID=$STUB_JOB_ID SLURM_STEP_NODELIST=localhost SLURM_NTASKS=$STUB_NTASKS \
        SLURM_PROCID=$i SLURM_LOCALID=0 "$@" > "$STUB_OUT.$i" 2>&1 &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
"""


def render_slurm(tmp_path, command):
    (text,) = templates.slurm(job(command), log_dir=str(tmp_path), venv="").values()
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    return path, text


def test_sbatch_script_is_valid_bash_asking_one_task_per_host_with_all_its_gpus(tmp_path):
    path, text = render_slurm(tmp_path, PRETRAIN)
    subprocess.run(["bash", "-n", str(path)], check=True)
    options = dict(re.findall(r"^#SBATCH --([\w-]+)=?(.*)$", text, re.M))
    assert options["nodes"] == "2" and options["ntasks-per-node"] == "1"
    assert options["gpus-per-task"] == "8" and "exclusive" in options
    assert f"export XLA_FLAGS={shlex.quote(presets.xla_flags('h200'))}" in text
    (srun,) = [line for line in text.splitlines() if line.startswith("srun ")]
    argv = shlex.split(srun)
    module = argv[argv.index("-m") + 1]
    assert module == "launch.pretrain" and importlib.util.find_spec(module)
    assert argv[argv.index("-m") + 2 :] == list(PRETRAIN[1:])


def test_sbatch_script_forms_a_two_process_job_with_eight_gpus_per_task(tmp_path):
    path, _ = render_slurm(tmp_path, PROBE)
    stub = tmp_path / "bin" / "srun"
    stub.parent.mkdir()
    stub.write_text(STUB_SRUN)
    stub.chmod(0o755)
    # JAX's SLURM detection takes the coordinator port from the job id.
    job_id = free_port(61440) - 61440
    env = cpu_env(STUB_NTASKS="2", STUB_JOB_ID=str(job_id), STUB_OUT=str(tmp_path / "task"))
    env["PATH"] = f"{stub.parent}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}"
    env["PATH"] += os.environ["PATH"]
    subprocess.run(["bash", str(path)], env=env, check=True, timeout=180, cwd=tmp_path)
    reports = [(tmp_path / f"task.{i}").read_text().strip().splitlines()[-1] for i in range(2)]
    for i, line in enumerate(reports):
        report = json.loads(line)
        assert report["process_index"] == i and report["process_count"] == 2
        assert report["local_device_ids"] == "0,1,2,3,4,5,6,7"  # not just GPU SLURM_LOCALID
        assert report["argv"] == list(PROBE[1:])


# ----------------------------------------------------------------------------- Kubernetes


def load_jobset(text):
    """(Service, JobSet, the JobSet's replicated job, its container) of a rendered manifest."""
    service, jobset = yaml.safe_load_all(text)
    (replicated,) = jobset["spec"]["replicatedJobs"]
    (container,) = replicated["template"]["spec"]["template"]["spec"]["containers"]
    return service, jobset, replicated, container


def test_jobset_manifest_is_a_headless_service_and_an_indexed_job_of_two_pods():
    (text,) = templates.jobset(job(), image="reg/cj:1", pvc="runs").values()
    service, jobset, replicated, container = load_jobset(text)
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert jobset["kind"] == "JobSet" and jobset["spec"]["network"]["subdomain"] == "tiny-2x8"
    spec = replicated["template"]["spec"]
    assert spec["parallelism"] == spec["completions"] == 2 and spec["completionMode"] == "Indexed"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["command"] == ["python", "-m", *PRETRAIN]
    assert importlib.util.find_spec(container["command"][2])
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["XLA_FLAGS"] == presets.xla_flags("h200") and env["JAX_NUM_PROCESSES"] == "2"
    # Pod 0's host name as JobSet makes it: <jobset>-<replicated job>-<job index>-<pod index>.
    host = f"{jobset['metadata']['name']}-{replicated['name']}-0-0.{service['metadata']['name']}"
    assert env["JAX_COORDINATOR_ADDRESS"] == f"{host}:8476"
    assert "job-completion-index" in env["JAX_PROCESS_ID"]["fieldRef"]["fieldPath"]
    runtime = open(os.path.join(REPO, "launch", "runtime.py")).read()
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        assert f'"{name}"' in runtime  # the names launch/runtime.py reads


def test_jobset_environment_forms_a_two_process_job_through_launch_runtime():
    (text,) = templates.jobset(job(PROBE), image="x", pvc="c").values()
    container = load_jobset(text)[3]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env["JAX_COORDINATOR_ADDRESS"] = f"localhost:{free_port(20000)}"  # pod 0, here
    procs = [
        subprocess.Popen(
            container["command"],
            env=cpu_env(**env, JAX_PROCESS_ID=str(i)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    for i, out in enumerate(outputs):
        report = json.loads(out.strip().splitlines()[-1])
        assert report["process_index"] == i and report["process_count"] == 2, out


def test_jobset_on_several_pods_needs_the_workdir_on_a_shared_claim():
    with pytest.raises(
        ValueError, match="2 pods need a shared workdir: give --pvc .* or a gs:// --config.workdir"
    ):
        templates.jobset(job(), "img")
    with pytest.raises(ValueError, match="workdir=runs/x is not on the shared claim: use a path"):
        templates.jobset(job(("launch.pretrain", "--config.workdir=runs/x")), "img", pvc="c")
    with pytest.raises(ValueError, match="the config's workdir is not on the shared claim"):
        templates.jobset(job(("launch.pretrain",)), "img", pvc="c")
    templates.jobset(job(("launch.pretrain",), nodes=1), "img")  # one pod: its disk is enough
    templates.jobset(job(("launch.rl", "--config.workdir=gs://bucket/run")), "img")  # shared


# ----------------------------------------------------------------------------- Docker


def test_dockerfile_installs_the_cuda12_extra_on_a_cuda12_base_and_runs_a_real_module():
    (text,) = templates.dockerfile(job(gpu="b200")).values()
    assert re.search(r"^FROM nvidia/cuda:12\.[\d.]+-\S+$", text, re.M)
    assert 'RUN pip install ".[cuda12]"' in text
    assert f"XLA_FLAGS={json.dumps(presets.xla_flags('b200'))}" in text
    (cmd,) = [json.loads(line[4:]) for line in text.splitlines() if line.startswith("CMD ")]
    assert cmd == ["python", "-m", *PRETRAIN] and importlib.util.find_spec(cmd[2])
    setup = configparser.ConfigParser()
    setup.read(os.path.join(REPO, "setup.cfg"))
    assert "jax[cuda12]>=0.11.2" in setup["options.extras_require"]["cuda12"].split()
    ignored = open(os.path.join(REPO, ".dockerignore")).read().split()
    assert {".venv/", "runs/"} <= set(ignored)


# ----------------------------------------------------------------------------- the renderer


def render_cli(tmp_path, *args):
    return subprocess.run(
        [sys.executable, "-m", "launch.cluster.render", f"--out={tmp_path}", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=cpu_env(),
        timeout=120,
    )


def test_renderer_writes_the_file_and_says_how_to_submit_it(tmp_path):
    result = render_cli(
        tmp_path, "--kind=jobset", "--nodes=2", "--gpu=h100", "--pvc=runs", "--", *PRETRAIN
    )
    assert result.returncode == 0, result.stderr
    path = tmp_path / "pretrain.jobset.yaml"
    assert result.stdout.splitlines()[-1] == f"submit: kubectl apply -f {path}"
    assert [d["kind"] for d in yaml.safe_load_all(path.read_text())] == ["Service", "JobSet"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--kind=slurm", "--gpu=a100", "--", "launch.pretrain"], "unknown GPU kind 'a100'"),
        (["--kind=slurm", "--gpu=h100", "--nodes=0", "--", "launch.pretrain"], "nodes must be"),
        (["--kind=slurm", "--gpu=h100", "--", "launch.nope"], "no module 'launch.nope'"),
        (["--kind=k8s", "--gpu=h100", "--", "launch.pretrain"], "--kind=k8s: one of"),
        (["--kind=slurm", "--gpu=h100"], "no command"),
    ],
)
def test_renderer_ends_bad_input_with_one_line(tmp_path, args, message):
    result = render_cli(tmp_path, *args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert message in result.stderr
