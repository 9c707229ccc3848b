"""Ray placement: the rl.ray_* fields, and on a local two-node cluster (`ray.cluster_utils`) the
sampler and the environment workers land on the node whose custom resource they name, run the
shipped project (runtime_env), and resources no node has fail naming them."""

import dataclasses
import sys

import pytest

from composer_jax import config, presets
from composer_jax.actor.setup import store_dir
from composer_jax.config import ConfigError, RLConfig, RolloutConfig
from composer_jax.config.rl import parse_resources
from launch.runtime import ray_runtime_env


def test_resource_specs_parse_and_bad_ones_name_the_field():
    assert parse_resources("", "f") == {}
    assert parse_resources("gpu_host=1, zone_a=0.5", "f") == {"gpu_host": 1.0, "zone_a": 0.5}
    for bad in ("gpu_host", "gpu_host=", "=1", "a=x", "a=0", "a=-1", "GPU=1", "CPU=2"):
        with pytest.raises(ConfigError, match=r"^rl\.rollout\.ray_env_resources: "):
            config.validate_rl(
                RLConfig(rollout=RolloutConfig(backend="ray", ray_env_resources=bad))
            )


def test_ray_fields_are_validated_and_need_the_ray_backend():
    config.validate_rl(RLConfig())  # the defaults: threads backend, nothing placed
    config.validate_rl(
        RLConfig(
            rollout=RolloutConfig(
                backend="ray",
                ray_sampler_gpus=1,
                ray_sampler_resources="gpu_host=1",
                ray_env_resources="cpu_host=1",
            )
        )
    )
    assert (
        RLConfig().rollout.ray_sampler_gpus == 0
    )  # a CPU-only cluster can place the default sampler
    for overrides, field in (
        ({"backend": "ray", "ray_sampler_gpus": -1}, "ray_sampler_gpus"),
        ({"backend": "ray", "ray_placement_timeout_s": 0}, "ray_placement_timeout_s"),
        ({"ray_sampler_gpus": 1}, "ray_sampler_gpus"),
        ({"ray_sampler_resources": "gpu_host=1"}, "ray_sampler_resources"),
        ({"ray_placement_timeout_s": 10}, "ray_placement_timeout_s"),
        ({"num_samplers": 2}, "num_samplers"),
        ({"backend": "ray", "num_samplers": 0}, "num_samplers"),
        ({"backend": "ray", "env_workers": "thread"}, "env_workers"),
    ):
        with pytest.raises(ConfigError, match=rf"^rl\.rollout\.{field}: "):
            config.validate_rl(RLConfig(rollout=RolloutConfig(**overrides)))


def test_a_relative_weight_store_is_made_absolute(tmp_path, monkeypatch):
    """Ray actors run in their runtime_env's copy of the project, not in this folder."""
    monkeypatch.chdir(tmp_path)
    cfg = presets.rl_tiny()
    cfg = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, weight_store="w"))
    assert store_dir(cfg) == str(tmp_path / "w" / "attempt-0")


@pytest.fixture(scope="module")
def two_nodes():
    """A head with the `gpu_host` resource and one CPU, a worker with `cpu_host` and two."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"gpu_host": 1}}
    )
    worker = cluster.add_node(num_cpus=2, resources={"cpu_host": 2})
    cluster.wait_for_nodes()
    ray.init(
        address=cluster.address,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env=ray_runtime_env(),
    )
    try:
        yield ray, cluster.head_node.node_id, worker.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_and_module(ray, actor):
    """The actor's node and where its composer_jax was imported from."""
    return ray.get(
        actor.__ray_call__.remote(
            lambda _: (
                ray.get_runtime_context().get_node_id(),
                sys.modules["composer_jax"].__file__,
            )
        )
    )


def test_sampler_and_environment_workers_land_on_the_nodes_they_name(two_nodes, tmp_path):
    from composer_jax.actor.ray_backend import RayEnvironmentPool, RaySampler

    ray, head, worker = two_nodes
    sampler = RaySampler(
        presets.rl_tiny().model,
        str(tmp_path / "weights"),
        num_slots=2,
        max_len=64,
        resources={"gpu_host": 1},
        placement_timeout_s=120,
    )
    node, module = _node_and_module(ray, sampler.actor)
    assert node == head
    assert "runtime_resources" in module  # the shipped copy of the project, not this checkout
    with RayEnvironmentPool(num_workers=2, timeout_s=60, resources={"cpu_host": 1}) as pool:
        places = [_node_and_module(ray, actor) for actor in pool.actors().values()]
    assert [node for node, _ in places] == [worker, worker]
    assert all("runtime_resources" in module for _, module in places)


def test_resources_no_node_has_fail_naming_them(two_nodes, tmp_path):
    from composer_jax.actor.ray_backend import RayEnvironmentPool, RayPlacementError, RaySampler

    with pytest.raises(RayPlacementError, match=r"sampler.*'tpu_host': 1.*'gpu_host': 1"):
        RaySampler(
            presets.rl_tiny().model,
            str(tmp_path / "weights"),
            num_slots=2,
            max_len=64,
            resources={"tpu_host": 1},
            placement_timeout_s=2,
        )
    with pytest.raises(RayPlacementError, match=r"environment worker.*'cpu_host': 3"):
        RayEnvironmentPool(num_workers=1, resources={"cpu_host": 3}, placement_timeout_s=2)
