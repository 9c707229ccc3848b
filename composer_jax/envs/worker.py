"""The worker side of the environment pools (`composer_jax.actor.env_workers`): episodes held by id.

JAX-free on purpose: a worker process runs `python -m composer_jax.envs.worker` and a Ray actor
imports `EpisodeHost` from here, so neither pulls in the trainer's stack. A worker process talks
to its parent over stdin/stdout in length-prefixed pickle frames: one request `(method, args)`,
one reply `(ok, value)`, after a first reply carrying its pid once it is ready.
"""

import dataclasses
import os
import pickle
import struct
import sys
import threading

from composer_jax.envs.environment import EnvConfig, Episode, StepResult
from composer_jax.envs.grading.task import Task
from composer_jax.envs.sandbox.box import SandboxLimits

FRAME_HEADER = struct.Struct("!Q")
_METHODS = ("start", "step", "snapshot", "close", "close_all")


def config_to_json(config: EnvConfig) -> dict:
    return dataclasses.asdict(config)


def config_from_json(data: dict) -> EnvConfig:
    data = dict(data)
    data["tools"] = tuple(data["tools"])
    for key in ("limits", "grading_limits"):
        data[key] = SandboxLimits(**data[key])
    return EnvConfig(**data)


class EpisodeHost:
    """The episodes of one worker by id (a worker process, a Ray actor or the thread pool).

    `workspace_root` collects the workspaces of configs that name none, so the pool can remove
    what a killed worker leaves behind.
    """

    def __init__(self, workspace_root: str | None = None):
        self.workspace_root = workspace_root
        self._episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()

    def start(
        self, episode_id: str, task: Task, config: EnvConfig, snapshot: dict | None = None
    ) -> str:
        """Starts the episode (resumed from `snapshot`, an `Episode.snapshot()`, if given);
        returns its prompt."""
        if config.workspace_root is None and self.workspace_root is not None:
            config = dataclasses.replace(config, workspace_root=self.workspace_root)
        with self._lock:
            if episode_id in self._episodes:
                raise ValueError(f"episode {episode_id!r} already started")
        episode = Episode(task, config)
        if snapshot is not None:
            try:
                episode.restore(snapshot)
            except BaseException:
                episode.close()
                raise
        with self._lock:
            self._episodes[episode_id] = episode
        return episode.prompt

    def _episode(self, episode_id: str) -> Episode:
        with self._lock:
            episode = self._episodes.get(episode_id)
        if episode is None:
            raise KeyError(f"unknown episode {episode_id!r}")
        return episode

    def step(self, episode_id: str, model_output: str) -> StepResult:
        return self._episode(episode_id).step(model_output)

    def snapshot(self, episode_id: str) -> dict:
        return self._episode(episode_id).snapshot()

    def close(self, episode_id: str) -> None:
        with self._lock:
            episode = self._episodes.pop(episode_id, None)
        if episode is not None:
            episode.close()

    def close_all(self) -> None:
        with self._lock:
            episodes, self._episodes = list(self._episodes.values()), {}
        for episode in episodes:
            episode.close()

    def handle(self, method: str, args: tuple) -> tuple[bool, object]:
        """Serves one wire request (tasks and configs as JSON): `(True, result)` or
        `(False, exception)`; never raises, so a failing call does not look like a crash."""
        try:
            if method not in _METHODS:
                raise ValueError(f"unknown method {method!r}")
            if method == "start":
                episode_id, task, config, *snapshot = args
                args = (episode_id, Task.from_json(task), config_from_json(config), *snapshot)
            return True, getattr(self, method)(*args)
        except Exception as error:
            return False, _portable(error)

    def pid(self) -> int:
        return os.getpid()


def _portable(error: Exception) -> Exception:
    """The exception itself when it survives pickling, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def encode_frame(message) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME_HEADER.pack(len(payload)) + payload


def read_frame(stream):
    """The next message on a blocking binary stream, or None at end of file."""
    header = stream.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return pickle.loads(payload)


def main(argv: list[str] | None = None) -> None:
    """Serves the parent until its end of the pipe closes, then frees every episode.

    The protocol moves to private copies of stdin/stdout; the standard descriptors become
    /dev/null and stderr, so nothing a library or a command prints can corrupt a frame.
    """
    argv = sys.argv[1:] if argv is None else argv
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    host = EpisodeHost(argv[0] if argv else None)
    try:
        replies.write(encode_frame((True, host.pid())))
        replies.flush()
        while (request := read_frame(requests)) is not None:
            replies.write(encode_frame(host.handle(*request)))
            replies.flush()
    except BrokenPipeError:
        pass
    finally:
        host.close_all()


if __name__ == "__main__":
    main()
