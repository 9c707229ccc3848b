"""The inference role of the actor loop: a continuous-batching engine fed by the weight store.

`Sampler` is the small interface the coordinator drives (submit / continue / restart a request,
poll finished turns, pull new weights); `LocalSampler` runs an `InferenceEngine` in the calling
thread, and the Ray backend runs the same class inside an actor. Weights arrive only through the
store (`WeightSubscriber`: compressed deltas rebuilt bitwise), so the sampler never shares memory
with the trainer and can live on another host. An update lands between two decode steps: running
requests keep their slots and later tokens carry the new version (in-flight update).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax.infer import Completion, InferenceEngine, SamplingParams
from composer_jax.model.transformer import Transformer
from composer_jax.trace import NULL_TRACER
from composer_jax.weight_sync import WeightSubscriber, open_store


class Sampler:
    """What the coordinator needs from inference."""

    num_slots: int
    max_len: int

    @property
    def version(self) -> int | None:
        raise NotImplementedError

    def submit(self, prompt: list[int], params: SamplingParams) -> int:
        raise NotImplementedError

    def continue_request(self, request_id: int, appended: list[int], params) -> int:
        raise NotImplementedError

    def restart_request(self, request_id: int, keep: int, appended: list[int], params) -> int:
        raise NotImplementedError

    def release(self, request_id: int) -> None:
        raise NotImplementedError

    def poll(self, max_steps: int = 8) -> list[Completion]:
        """Runs up to `max_steps` engine steps, stopping early once some request finished;
        returns the finished turns."""
        raise NotImplementedError

    def sync_weights(self, wait_for: int | None = None, timeout_s: float = 600.0) -> int | None:
        """Loads the newest published weights (waiting until `wait_for` is available, if given);
        returns the version held."""
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        raise NotImplementedError


class LocalSampler(Sampler):
    """An InferenceEngine on a model whose weights come from the store at `weight_store`;
    `tracer` records its engine steps and each new version's reload."""

    def __init__(
        self,
        model: Transformer,
        weight_store: str,
        num_slots: int,
        max_len: int,
        prefill_buckets: tuple[int, ...] = (64, 256),
        recompute_cache: bool = False,
        tracer=NULL_TRACER,
        publishers: int = 1,
        decode_chunk: int = 1,
    ):
        self.tracer = tracer
        self.graphdef, self._params, self._rest = nnx.split(model, nnx.Param, ...)
        self._dtypes = jax.tree.map(lambda x: x.dtype, self._params)
        buckets = tuple(sorted({*(b for b in prefill_buckets if b < max_len), max_len}))
        self.engine = InferenceEngine(
            model,
            num_slots=num_slots,
            max_len=max_len,
            prefill_buckets=buckets,
            version=-1,
            tracer=tracer,
            decode_chunk=decode_chunk,
        )
        self.num_slots, self.max_len = num_slots, max_len
        self.recompute_cache = recompute_cache
        # A trainer on several processes publishes each version as one part per process.
        self.subscriber = WeightSubscriber(open_store(weight_store), process_count=publishers)
        self.updates = 0
        self.update_seconds = 0.0
        self.generated_tokens = 0

    @property
    def version(self) -> int | None:
        return self.subscriber.version

    def submit(self, prompt, params):
        return self.engine.submit(prompt, params)

    def continue_request(self, request_id, appended, params):
        return self.engine.continue_request(request_id, appended, params)

    def restart_request(self, request_id, keep, appended, params):
        return self.engine.restart_request(request_id, keep, appended, params)

    def release(self, request_id):
        self.engine.release(request_id)

    def poll(self, max_steps: int = 8) -> list[Completion]:
        finished: list[int] = self.engine.take_finished()
        for _ in range(max_steps):
            if not self.engine.has_work:
                break
            finished += self.engine.step()
            if finished:
                break
        done = [self.engine.completions.pop(rid) for rid in finished]
        self.generated_tokens += sum(len(c.tokens) for c in done)
        return done

    def sync_weights(self, wait_for: int | None = None, timeout_s: float = 600.0) -> int | None:
        deadline = time.monotonic() + timeout_s
        while True:
            before = self.subscriber.version
            start = time.perf_counter()
            held = self.subscriber.update()
            if held is not None and held != before:
                self._load(held)
                self.tracer.complete("weight_reload", f"v{held}", start, time.perf_counter())
            if wait_for is None or (held is not None and held >= wait_for):
                return held
            if time.monotonic() > deadline:
                raise TimeoutError(f"weights version {wait_for} not published in {timeout_s} s")
            time.sleep(0.05)

    def _load(self, version: int) -> None:
        start = time.perf_counter()
        arrays = self.subscriber.tree_like(self._params)
        params = jax.tree.map(lambda a, dt: jnp.asarray(np.asarray(a), dt), arrays, self._dtypes)
        model = nnx.merge(self.graphdef, params, self._rest)
        self.engine.update_weights(model, version, recompute_cache=self.recompute_cache)
        self.updates += 1
        self.update_seconds += time.perf_counter() - start

    def stats(self) -> dict[str, float]:
        return {
            "weight_updates": self.updates,
            "weight_update_seconds": self.update_seconds,
            "generated_tokens": self.generated_tokens,
        }
