"""The parent's end of an environment worker process (`python -m composer_jax.envs.worker`):
length-prefixed pickle frames over its stdin/stdout, with reads and writes bounded by each call's
deadline, so a dead worker surfaces as `WorkerCrash` and a hung one as `WorkerTimeout`. No JAX.
"""

import os
import pickle
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from composer_jax.envs import worker as env_worker
from composer_jax.envs.sandbox import cgroups


class WorkerCrash(Exception):
    """The worker died or answered garbage."""


class WorkerTimeout(Exception):
    """The worker did not answer in time."""


class WorkerProcess:
    """A worker process and its pipes; reads and writes never block past the call's deadline."""

    def __init__(self, timeout_s: float):
        self.workspace_root = tempfile.mkdtemp(prefix="cj_envworker_")
        # exec, never fork: the parent holds JAX threads. Its own session keeps terminal
        # signals away; at EOF on stdin (the parent gone) it frees its episodes and exits.
        # Its temporary folders (the sandbox's made-up /etc, unshare's mount point) go under
        # the workspace root too, so a killed worker's are removed with it by `_release`.
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "composer_jax.envs.worker", self.workspace_root],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,
                env=dict(os.environ, TMPDIR=self.workspace_root),
            )
        except OSError:
            shutil.rmtree(self.workspace_root, ignore_errors=True)
            raise
        self.pid = self.process.pid
        self._writable = selectors.DefaultSelector()
        self._writable.register(self.process.stdin, selectors.EVENT_WRITE)
        self._readable = selectors.DefaultSelector()
        self._readable.register(self.process.stdout, selectors.EVENT_READ)
        os.set_blocking(self.process.stdin.fileno(), False)
        os.set_blocking(self.process.stdout.fileno(), False)
        try:
            self._receive(time.monotonic() + timeout_s)  # the worker's ready message
        except BaseException:
            self.kill()
            raise

    def call(self, request: tuple, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        data = memoryview(env_worker.encode_frame(request))
        while data:
            self._wait(self._writable, deadline)
            try:
                data = data[os.write(self.process.stdin.fileno(), data) :]
            except BlockingIOError:
                continue
            except OSError:
                raise WorkerCrash(self._exit_description()) from None
        return self._receive(deadline)

    def _receive(self, deadline: float):
        (size,) = env_worker.FRAME_HEADER.unpack(self._read(env_worker.FRAME_HEADER.size, deadline))
        payload = self._read(size, deadline)
        try:
            return pickle.loads(payload)
        except Exception as error:
            raise WorkerCrash(f"sent an unreadable reply ({error})") from None

    def _read(self, size: int, deadline: float) -> bytes:
        data = bytearray()
        while len(data) < size:
            self._wait(self._readable, deadline)
            try:
                chunk = os.read(self.process.stdout.fileno(), size - len(data))
            except BlockingIOError:
                continue
            if not chunk:
                raise WorkerCrash(self._exit_description())
            data += chunk
        return bytes(data)

    @staticmethod
    def _wait(selector: selectors.BaseSelector, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not selector.select(remaining):
            raise WorkerTimeout()

    def _exit_description(self) -> str:
        try:
            code = self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return f"(pid {self.pid}) closed its pipe"
        if code < 0:
            return f"(pid {self.pid}) was killed by {signal.Signals(-code).name}"
        return f"(pid {self.pid}) exited with status {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._release()

    def stop(self, timeout_s: float) -> None:
        """Closes the pipe: the worker frees its episodes and exits (killed if it does not)."""
        self.process.stdin.close()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._release()

    def _release(self) -> None:
        """Closes the pipes, kills the commands a killed worker left running (by their cgroups)
        and removes the workspaces it could not."""
        cgroups.sweep(self.pid)
        self._writable.close()
        self._readable.close()
        self.process.stdin.close()
        self.process.stdout.close()
        shutil.rmtree(self.workspace_root, ignore_errors=True)
