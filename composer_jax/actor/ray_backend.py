"""The Ray backend: the sampler as a Ray actor on any host of the cluster.

The actor builds the model from its config and takes every weight from the store (the trainer
publishes compressed deltas there; use a shared directory or a tensorstore URL across hosts), so
nothing but requests, finished turns and the store's location cross the network. Environment
workers are Ray actors too (`RayEnvironmentPool`). A sampler actor that dies is
replaced by a fresh one and the coordinator re-queues the samples it held.
"""

from __future__ import annotations

from composer_jax.actor.env_workers import WorkerPool
from composer_jax.actor.sampler import LocalSampler, Sampler
from composer_jax.actor.worker_process import WorkerCrash, WorkerTimeout
from composer_jax.config import ModelConfig
from composer_jax.envs.worker import EpisodeHost


class SamplerLostError(RuntimeError):
    """The sampler actor died; every request it held is gone (a fresh actor has replaced it)."""


class _SamplerActor:
    """Runs inside the Ray actor: a LocalSampler on a model whose weights come from the store."""

    def __init__(
        self, model_cfg: ModelConfig, weight_store: str, num_slots, max_len, recompute, buckets
    ):
        from composer_jax.model import init_model

        model = init_model(model_cfg)  # placeholder values, replaced by the store's weights
        self.sampler = LocalSampler(
            model,
            weight_store,
            num_slots=num_slots,
            max_len=max_len,
            prefill_buckets=buckets,
            recompute_cache=recompute,
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
    """Driver-side handle: the Sampler interface over remote calls to the actor."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        weight_store: str,
        num_slots: int,
        max_len: int,
        recompute_cache: bool = False,
        actor_options: dict | None = None,
        prefill_buckets: tuple[int, ...] = (64, 256),
    ):
        self._ray = _require_ray()
        self._args = (model_cfg, weight_store, num_slots, max_len, recompute_cache, prefill_buckets)
        self._options = actor_options or {}
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
    """A Ray actor holding an `EpisodeHost`."""

    def __init__(self, ray, actor_class, timeout_s: float):
        self._ray = ray
        self.actor = actor_class.remote()
        try:
            self._get(self.actor.pid.remote(), timeout_s)
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
    """Workers are Ray actors; the caller runs `ray.init`. `actor_options` go to `.options()`
    (e.g. resources that place environments on CPU hosts)."""

    def __init__(
        self, num_workers: int = 2, timeout_s: float = 60.0, actor_options: dict | None = None
    ):
        try:
            import ray
        except ImportError as error:
            raise ImportError(
                "RayEnvironmentPool needs ray: pip install 'composer-jax[ray]'"
            ) from error
        self._ray = ray
        self._actor_class = ray.remote(EpisodeHost).options(**(actor_options or {}))
        super().__init__(num_workers, timeout_s)

    def _launch(self) -> _RayWorker:
        return _RayWorker(self._ray, self._actor_class, self.timeout_s)

    def actors(self) -> dict:
        """Worker index -> its current actor handle."""
        workers = [(slot.index, slot.worker) for slot in self._slots]
        return {index: worker.actor for index, worker in workers if worker is not None}
