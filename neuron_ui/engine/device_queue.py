"""Who gets the device next: users first come, first served; background warm-up only when no user waits.

One pipeline run at a time is a hardware fact (one NeuronCore group, one GPU); a plain lock would let
a background warm-up grab the device again between two compilations while a user waits, and would not
serve users in the order they came.

close() is the first half of a graceful shutdown: nothing new gets the device, everyone waiting is told so at
once, and the caller waits (bounded) for the run already on the device to finish.

A user's StopToken takes them out of the queue at once; while they wait, `on_wait` hears what is ahead of them
(the `job` each waiting user came with) when they join, whenever the queue moves, and every REPORT_SECONDS.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from neuron_ui.contract.errors import EngineError
from neuron_ui.contract.stopping import Stopped

if TYPE_CHECKING:
    from neuron_ui.contract.stopping import StopToken


SHUTTING_DOWN = "the server is shutting down; try again in a moment"
LEFT_THE_QUEUE = "stopped: you left the queue; no image was made"
REPORT_SECONDS = 1.0  # how often a waiting user hears how long is left


@dataclass(eq=False)
class _Ticket:
    job: Any


class DeviceQueue:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._waiting: deque[_Ticket] = deque()
        self._closed = False

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def waiting(self) -> int:
        """Users waiting for the device (not counting the one on it)."""
        return len(self._waiting)

    @contextmanager
    def user(self, stop: StopToken | None = None, job: Any = None,
             on_wait: Callable[[list[Any]], None] | None = None) -> Iterator[None]:
        """Hold the device for a user's request, after every user who came before; a stop leaves the queue."""
        ticket = _Ticket(job)
        forget = stop.listen(self._wake) if stop is not None else (lambda: None)
        try:
            with self._cond:
                self._waiting.append(ticket)
            try:
                self._wait_turn(ticket, stop, on_wait)
            finally:
                with self._cond:
                    self._waiting.remove(ticket)
                    self._cond.notify_all()  # the users behind moved up
        finally:
            forget()
        try:
            yield
        finally:
            self._release()

    def _wait_turn(self, ticket: _Ticket, stop: StopToken | None, on_wait: Callable[[list[Any]], None] | None) -> None:
        def done() -> bool:
            return (self._closed or (stop is not None and stop.stopped)
                    or (not self._busy and self._waiting[0] is ticket))

        while True:
            with self._cond:
                if not done() and on_wait is None:
                    self._cond.wait_for(done)
                if done():
                    self._refuse_if_closed()
                    if stop is not None and stop.stopped:
                        raise Stopped(LEFT_THE_QUEUE)
                    self._busy = True
                    return
                ahead = [t.job for t in list(self._waiting)[: self._ahead(ticket)]]
            on_wait(ahead)  # outside the lock: it may take its time (an engine's estimates, a progress bar)
            with self._cond:
                self._cond.wait_for(lambda: done() or self._ahead(ticket) != len(ahead), REPORT_SECONDS)

    def _ahead(self, ticket: _Ticket) -> int:
        return self._waiting.index(ticket)

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

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
