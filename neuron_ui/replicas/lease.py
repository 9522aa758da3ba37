"""The per-shape compile lease: a file lock that lets one replica in the whole deployment compile a graph while
the others wait and then load it from the shared cache (the one thing multiplexing cannot do by itself)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


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
