"""Host-side exchanges between the processes of one multi-controller JAX job.

Every process runs the same program over global arrays; these helpers carry what only process 0
knows (the RL batch it packed, the weight store it chose) to the others, place host data that every
process holds as global arrays, and bring global arrays back to one host (a model to sample or
evaluate with on process 0's own devices). With one process they cost nothing.
"""

from __future__ import annotations

import pickle
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src import distributed
from jax.experimental import multihost_utils


def is_leader() -> bool:
    """Process 0: the one that owns the job's host-side state (rollouts, ledger, metrics)."""
    return jax.process_index() == 0


class LeaderChannel:
    """An ordered stream of (kind, payload) commands from process 0 to the others.

    Carried by the distributed runtime's key-value store rather than a device collective: a
    follower may wait minutes for the next command (while process 0 evaluates or waits for
    rollouts), and an XLA:CPU (gloo) collective's first meeting of a device set gives up after
    30 s. JAX has no public API for that store (its compilation cache and array serialization
    reach it the same way). A payload is pickled and split into chunks under `<name>/<n>/<i>`.
    Each follower acknowledges every command it reads; process 0 deletes a command `RETAINED`
    commands later, once every follower has acknowledged it (waiting for that if a follower lags
    so far behind), so the store holds a bounded window of the stream.
    """

    CHUNK = 1 << 20
    RETAINED = 8

    def __init__(self, name: str, timeout_s: float = 24 * 3600.0):
        self.name, self.timeout_ms = name, int(timeout_s * 1000)
        self._client = distributed.global_state.client if jax.process_count() > 1 else None
        self._sent = self._received = 0

    def _key(self, number: int) -> str:
        return f"{self.name}/{number:012d}"  # fixed width: no key is a prefix of another

    def send(self, kind: str, payload: Any = None) -> None:
        """Process 0: queue a command for every other process (a no-op with one process)."""
        if self._client is None:
            return
        data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        chunks = [data[i : i + self.CHUNK] for i in range(0, len(data), self.CHUNK)] or [b""]
        key = self._key(self._sent)
        for index, chunk in enumerate(chunks):
            self._client.key_value_set_bytes(f"{key}/{index}", chunk)
        self._client.key_value_set(key, str(len(chunks)))  # written last: the command is whole
        if self._sent >= self.RETAINED:
            old = self._key(self._sent - self.RETAINED)
            for process in range(1, jax.process_count()):
                self._client.blocking_key_value_get(f"{old}/ack/{process}", self.timeout_ms)
            self._client.key_value_delete(old)  # with its chunks and acknowledgements
        self._sent += 1

    def receive(self) -> tuple[str, Any]:
        """Another process: the next command, waiting for it as long as `timeout_s`."""
        key = self._key(self._received)
        count = int(self._client.blocking_key_value_get(key, self.timeout_ms))
        data = b"".join(
            self._client.blocking_key_value_get_bytes(f"{key}/{i}", self.timeout_ms)
            for i in range(count)
        )
        self._client.key_value_set(f"{key}/ack/{jax.process_index()}", "1")
        self._received += 1
        return pickle.loads(data)


def place_global(tree: Any, shardings: Any) -> Any:
    """Host arrays that every process holds in full, as global arrays with `shardings`: each
    process places only its own devices' slices (no cross-process check or transfer)."""

    def place(x, sharding):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(place, tree, shardings)


def host_model(model: nnx.Module) -> nnx.Module:
    """`model` with every array on this process's default device.

    A model restored or trained over all processes' devices cannot be run by one process alone
    (each of its computations would wait for the others); the leader samples and evaluates with
    this copy. Gathering is a collective; with one process the model is returned as it is.
    """
    if jax.process_count() == 1:
        return model
    graphdef, state = nnx.split(model)
    gathered = multihost_utils.process_allgather(state, tiled=True)
    return nnx.merge(graphdef, jax.tree.map(jnp.asarray, gathered))
