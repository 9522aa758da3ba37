"""The status board every replica reports to, and the per-shape compile lease."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Any

import ray

NAMESPACE = "neuron-ui"
REPORT_SECONDS = 1.0  # how often a replica tells the board what it holds
STALE_SECONDS = 4.0  # a replica silent this long is "not responding" (killed, or its process stuck)
FORGET_SECONDS = 60.0  # ... and this long, gone from the status
APP_NAME = "neuron-ui"


class ShapeLease:
    """An exclusive lock on one (compile key, token count) in the shared cache folder, held while a replica
    compiles or loads that graph; released after its first request there, so others then load from the cache."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks while another replica compiles this graph
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def held_elsewhere(self) -> bool:
        """True when another process holds the lock now (for the progress line only; it may change at once)."""
        if not self.path.exists():
            return False
        fd = os.open(self.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops the probe's lock if it got one
        return False


@ray.remote(num_cpus=0)
class ReplicaBoard:
    """Where replicas say, every second, what they hold; the front reads it for status, /healthz and /metrics."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}
        self._tokenizer: Any = None  # the model's tokenizer, for the front's prompt counter

    def share_tokenizer(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def tokenizer(self) -> Any:
        return self._tokenizer

    def report(self, replica: str, snapshot: dict[str, Any]) -> None:
        self._reports[replica] = (time.time(), snapshot)

    def read(self) -> dict[str, tuple[float, dict[str, Any]]]:
        now = time.time()
        self._reports = {k: v for k, v in self._reports.items() if now - v[0] < FORGET_SECONDS}
        return {k: (now - seen, snapshot) for k, (seen, snapshot) in self._reports.items()}


def find_board(name: str, timeout: float = 30.0):
    """The front's board actor; on a loaded cluster its name may register a moment after a replica looks for it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # "Failed to look up actor with name ..."
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
