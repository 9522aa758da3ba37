"""Who gets the device next: users first come, first served; background warm-up only when no user waits.

One pipeline run at a time is a hardware fact (one NeuronCore group, one GPU); a plain lock would let
a background warm-up grab the device again between two compilations while a user waits, and would not
serve users in the order they came.

close() is the first half of a graceful shutdown: nothing new gets the device, everyone waiting is told so at
once, and the caller waits (bounded) for the run already on the device to finish.
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from typing import Iterator

from .schema import EngineError

SHUTTING_DOWN = "the server is shutting down; try again in a moment"


class DeviceQueue:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._waiting: deque[object] = deque()
        self._closed = False

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def waiting(self) -> int:
        """Users waiting for the device (not counting the one on it)."""
        return len(self._waiting)

    @contextmanager
    def user(self) -> Iterator[None]:
        """Hold the device for a user's request, after every user who came before."""
        ticket = object()
        with self._cond:
            self._waiting.append(ticket)
            try:
                self._cond.wait_for(lambda: self._closed or (not self._busy and self._waiting[0] is ticket))
            finally:
                self._waiting.remove(ticket)
            self._refuse_if_closed()
            self._busy = True
        try:
            yield
        finally:
            self._release()

    @contextmanager
    def background(self) -> Iterator[None]:
        """Hold the device for background work, only when no user is waiting for it."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or (not self._busy and not self._waiting))
            self._refuse_if_closed()
            self._busy = True
        try:
            yield
        finally:
            self._release()

    def close(self, timeout: float) -> bool:
        """Refuse the device to everyone from now on; True once the run on it (if any) has ended within `timeout`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._busy, timeout)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise EngineError(SHUTTING_DOWN, kind="shutting_down")

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()
