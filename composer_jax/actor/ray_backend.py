"""The Ray backend: the sampler as a Ray actor on any host of the cluster.

The actor builds the model from its config and takes every weight from the store (the trainer
publishes compressed deltas there; use a shared directory or a tensorstore URL across hosts), so
nothing but requests, finished turns and the store's location cross the network. Environment
workers are Ray actors too (`RayEnvironmentPool`). A sampler actor that dies is
replaced by a fresh one and the coordinator re-queues the samples it held. Several samplers
stand behind the coordinator as one `sampler_group.SamplerGroup`.

Placement is Ray's own: the sampler reserves its node in a placement group (one CPU, its GPUs,
custom resources such as a GPU host's `ray start --resources`), environment workers ask for
custom resources of CPU-only hosts. An actor no node takes within `placement_timeout_s` fails
with `RayPlacementError` naming what it asked for, instead of waiting forever.
"""

from __future__ import annotations

from composer_jax.actor.env_workers import WorkerPool
from composer_jax.actor.sampler import LocalSampler, Sampler
from composer_jax.actor.worker_process import WorkerCrash, WorkerTimeout
from composer_jax.config import ModelConfig
from composer_jax.envs.worker import EpisodeHost
from composer_jax.model import init_model


class RayPlacementError(RuntimeError):
    """No node of the Ray cluster took an actor's resources in time."""


def _placement_error(ray, what: str, request: dict, timeout_s: float) -> RayPlacementError:
    """Names the request and what each live node has, so a typo or a missing node shows."""
    nodes = [
        {k: v for k, v in node["Resources"].items() if "memory" not in k and ":" not in k}
        for node in ray.nodes()
        if node["Alive"]
    ]
    return RayPlacementError(
        f"no Ray node took the {what} ({request}) within {timeout_s:g} s; "
        f"the cluster's nodes have {nodes}"
    )


class SamplerLostError(RuntimeError):
    """The sampler actor died; every request it held is gone (a fresh actor has replaced it)."""


class _SamplerActor:
    """Runs inside the Ray actor: a LocalSampler on a model whose weights come from the store."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        weight_store: str,
        num_slots,
        max_len,
        recompute,
        buckets,
        publishers,
        decode_chunk,
    ):
        model = init_model(model_cfg)  # placeholder values, replaced by the store's weights
        self.sampler = LocalSampler(
            model,
            weight_store,
            num_slots=num_slots,
            max_len=max_len,
            prefill_buckets=buckets,
            recompute_cache=recompute,
            publishers=publishers,
            decode_chunk=decode_chunk,
        )

    def call(self, method: str, *args):
        result = getattr(self.sampler, method)(*args)
        return result, self.sampler.version


def _require_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("the Ray backend needs Ray: pip install 'composer-jax[ray]'") from None
    if not ray.is_initialized():
        raise RuntimeError("call ray.init() (or launch.runtime.initialize_ray()) first")
    return ray


class RaySampler(Sampler):
    """Driver-side handle: the Sampler interface over remote calls to the actor.

    The actor lives in its own placement group: one bundle of 1 CPU, `num_gpus` GPUs and the
    custom `resources`, kept for the job's life so a replacement actor lands on the same node.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        weight_store: str,
        num_slots: int,
        max_len: int,
        recompute_cache: bool = False,
        prefill_buckets: tuple[int, ...] = (64, 256),
        num_gpus: float = 0.0,
        resources: dict[str, float] | None = None,
        placement_timeout_s: float = 300.0,
        publishers: int = 1,
        decode_chunk: int = 1,
    ):
        ray = self._ray = _require_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": 1.0, **({"GPU": num_gpus} if num_gpus else {}), **(resources or {})}
        self.placement_group = placement_group([bundle])
        ready, _ = ray.wait([self.placement_group.ready()], timeout=placement_timeout_s)
        if not ready:
            remove_placement_group(self.placement_group)
            raise _placement_error(ray, "sampler's placement group", bundle, placement_timeout_s)
        self._args = (
            model_cfg,
            weight_store,
            num_slots,
            max_len,
            recompute_cache,
            prefill_buckets,
            publishers,
            decode_chunk,
        )
        self._options = {
            "num_cpus": 1,
            "num_gpus": num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self.placement_group, 0),
        }
        self.num_slots, self.max_len = num_slots, max_len
        self._version: int | None = None
        self.replacements = 0
        self._actor = self._launch()

    def _launch(self):
        actor_class = self._ray.remote(_SamplerActor)
        return actor_class.options(**self._options).remote(*self._args)

    def _call(self, method: str, *args):
        try:
            result, self._version = self._ray.get(self._actor.call.remote(method, *args))
        except self._ray.exceptions.RayActorError as e:
            self.replacements += 1
            self._version = None
            self._actor = self._launch()
            raise SamplerLostError(f"sampler actor died during {method}: {e}") from e
        return result

    def kill(self) -> None:
        """Kills the actor (fault-injection in tests); the next call fails and replaces it."""
        self._ray.kill(self._actor)

    @property
    def actor(self):
        """The current actor's handle."""
        return self._actor

    @property
    def version(self) -> int | None:
        return self._version

    def submit(self, prompt, params):
        return self._call("submit", prompt, params)

    def continue_request(self, request_id, appended, params):
        return self._call("continue_request", request_id, appended, params)

    def restart_request(self, request_id, keep, appended, params):
        return self._call("restart_request", request_id, keep, appended, params)

    def release(self, request_id):
        return self._call("release", request_id)

    def poll(self, max_steps: int = 8):
        return self._call("poll", max_steps)

    def sync_weights(self, wait_for=None, timeout_s=600.0):
        return self._call("sync_weights", wait_for, timeout_s)

    def stats(self):
        stats = dict(self._call("stats"))
        stats["sampler_replacements"] = self.replacements
        return stats


class _RayWorker:
    """A Ray actor holding an `EpisodeHost`; it must answer within `start_timeout_s` (placement,
    runtime_env set-up, imports)."""

    def __init__(self, ray, actor_class, start_timeout_s: float, resources: dict):
        self._ray = ray
        self.actor = actor_class.remote()
        try:
            self._get(self.actor.pid.remote(), start_timeout_s)
        except WorkerTimeout:
            self.kill()
            raise _placement_error(ray, "environment worker", resources, start_timeout_s) from None
        except BaseException:
            self.kill()
            raise

    def call(self, request: tuple, timeout_s: float):
        return self._get(self.actor.handle.remote(*request), timeout_s)

    def _get(self, ref, timeout_s: float):
        ready, _ = self._ray.wait([ref], timeout=timeout_s)
        if not ready:
            raise WorkerTimeout()
        try:
            return self._ray.get(ref)
        except self._ray.exceptions.RayError as error:
            raise WorkerCrash(f"(actor) died: {type(error).__name__}") from error

    def kill(self) -> None:
        self._ray.kill(self.actor, no_restart=True)

    def stop(self, timeout_s: float) -> None:
        try:
            self.call(("close_all", ()), timeout_s)
        except (WorkerCrash, WorkerTimeout):
            pass
        self.kill()


class RayEnvironmentPool(WorkerPool):
    """Workers are Ray actors; the caller runs `ray.init`. `resources` (custom resources of the
    CPU-only hosts) place them, and then each worker also holds one CPU of its node (Ray's rule
    for actors that name resources), so a host takes as many workers as it has cores; a worker no
    node takes within `placement_timeout_s` fails."""

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float | None = None,
        resources: dict[str, float] | None = None,
        placement_timeout_s: float = 300.0,
    ):
        try:
            import ray
        except ImportError as error:
            raise ImportError(
                "RayEnvironmentPool needs ray: pip install 'composer-jax[ray]'"
            ) from error
        self._ray = ray
        self._resources = resources or {}
        self._start_timeout_s = placement_timeout_s
        self._actor_class = ray.remote(EpisodeHost).options(resources=self._resources)
        try:
            super().__init__(num_workers, timeout_s)
        except RuntimeError as error:  # keep the kind, so the entry point prints one line
            if isinstance(error.__cause__, RayPlacementError):
                raise RayPlacementError(str(error)) from error.__cause__
            raise

    def _launch(self) -> _RayWorker:
        return _RayWorker(self._ray, self._actor_class, self._start_timeout_s, self._resources)

    def actors(self) -> dict:
        """Worker index -> its current actor handle."""
        workers = [(slot.index, slot.worker) for slot in self._slots]
        return {index: worker.actor for index, worker in workers if worker is not None}
