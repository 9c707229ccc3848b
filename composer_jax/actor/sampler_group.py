"""Several samplers behind the one `Sampler` the coordinator drives (`rl.rollout.num_samplers`).

A new request goes to the sampler holding the fewest live requests and stays there for all its
turns (its cache lives there); request ids are `local id * N + sampler index`. Polls and weight
syncs go to every sampler at once from a thread each, so Ray actors decode in parallel. The group's
version is the oldest any sampler holds, so staleness admission stays conservative. When one
sampler is lost, the others release their requests too and the loss is re-raised: the coordinator
then starts every active sample over (simple and leak-free; it redoes the healthy samplers' work).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from composer_jax.actor.ray_backend import SamplerLostError
from composer_jax.actor.sampler import Sampler


class SamplerGroup(Sampler):
    """Load-balances requests over `samplers` (each with its own slots and weights)."""

    def __init__(self, samplers: list[Sampler]):
        if not samplers:
            raise ValueError("a sampler group needs at least one sampler")
        self.samplers = list(samplers)
        self.num_slots = sum(s.num_slots for s in self.samplers)
        self.max_len = min(s.max_len for s in self.samplers)
        self._live: list[set[int]] = [set() for _ in self.samplers]
        self._threads = ThreadPoolExecutor(len(self.samplers), thread_name_prefix="sampler")

    def _locate(self, request_id: int) -> tuple[int, int]:
        """Global id -> (sampler index, its local id)."""
        n = len(self.samplers)
        return request_id % n, request_id // n

    def _on(self, index: int, method: str, *args):
        """Calls one sampler; a loss there releases every other sampler's requests too."""
        try:
            return getattr(self.samplers[index], method)(*args)
        except SamplerLostError:
            self._release_all(lost={index})
            raise

    def _release_all(self, lost: set[int]) -> None:
        """Frees every live request of the samplers not `lost` (those lost theirs with them)."""
        n = len(self.samplers)
        for index, live in enumerate(self._live):
            if index not in lost:
                for request_id in live:
                    self.samplers[index].release(request_id // n)
            live.clear()

    def _each(self, method: str, *args) -> list:
        """Calls every sampler at once; a loss in any releases all requests and is re-raised."""
        futures = [self._threads.submit(getattr(s, method), *args) for s in self.samplers]
        errors = [f.exception() for f in futures]
        lost = {i for i, e in enumerate(errors) if isinstance(e, SamplerLostError)}
        if lost:
            self._release_all(lost)
            raise errors[min(lost)]
        return [f.result() for f in futures]

    def _track(self, index: int, old: int | None, local_id: int) -> int:
        request_id = local_id * len(self.samplers) + index
        self._live[index].discard(old)
        self._live[index].add(request_id)
        return request_id

    @property
    def version(self) -> int | None:
        versions = [s.version for s in self.samplers]
        return None if None in versions else min(versions)

    def submit(self, prompt, params):
        index = min(range(len(self.samplers)), key=lambda i: len(self._live[i]))
        return self._track(index, None, self._on(index, "submit", prompt, params))

    def continue_request(self, request_id, appended, params):
        index, local = self._locate(request_id)
        new = self._on(index, "continue_request", local, appended, params)
        return self._track(index, request_id, new)

    def restart_request(self, request_id, keep, appended, params):
        index, local = self._locate(request_id)
        new = self._on(index, "restart_request", local, keep, appended, params)
        return self._track(index, request_id, new)

    def release(self, request_id):
        index, local = self._locate(request_id)
        self._live[index].discard(request_id)
        self._on(index, "release", local)

    def poll(self, max_steps: int = 8):
        finished = []
        for index, completions in enumerate(self._each("poll", max_steps)):
            for completion in completions:
                completion.request_id = completion.request_id * len(self.samplers) + index
                finished.append(completion)
        return finished

    def sync_weights(self, wait_for=None, timeout_s=600.0):
        self._each("sync_weights", wait_for, timeout_s)
        return self.version

    def stats(self):
        """Each counter summed over the samplers."""
        total: dict[str, float] = {}
        for stats in self._each("stats"):
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
        return total
