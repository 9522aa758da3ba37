"""Who gets the device next: visitors in turn (Turns, below); background warm-up only when no user waits.

One pipeline run at a time is a hardware fact (one NeuronCore group, one GPU); a plain lock would let a background
warm-up grab the device again between two compilations while a user waits, and would serve whoever the OS wakes.
The replicas' front keeps one too, with a slot per replica (`slots`).

close() is the first half of a graceful shutdown: nothing new gets the device, everyone waiting is told so at
once, and the caller waits (bounded) for the run already on the device to finish.

A user's StopToken takes them out of the queue at once; while they wait, `on_wait` hears what is ahead of them
in the real order (the `job` each request came with) and how many of those are their own, when they join,
whenever that changes, and every REPORT_SECONDS.

Visitors take turns: among the requests waiting, the next one is the first request of the visitor whose turn came
longest ago; each visitor's own requests keep their order.

First come, first served let one visitor who queued twelve images hold the device for twelve image times while
the next person waited; turns give that person the device after at most the one image on it. A visitor is named by
the caller (the logged-in user, a browser's session, an API client's session); a request without one is a
visitor of its own, so requests that name nobody are served first come, first served, as before.

A visitor's place is the later of its last turn and the moment it came to wait (just before the turn given then):
a newcomer is not "never served, so first". Visitors are as cheap as sessions, and ranking every new one first let
a stranger sending one request at a time, each from a fresh session, go before a returning visitor again and again
(67 images in a row). Now whoever comes later ranks after a visitor already waiting, except the one visitor whose
image is on the device: a waiting request is overtaken only by the requests that were already waiting (first come,
first served at worst) and by newcomers until the next turn is given, at most.

Turns is plain bookkeeping, no threads or locks: DeviceQueue holds it under its own lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from itertools import takewhile
from typing import TYPE_CHECKING

from neuron_ui.contract.errors import EngineError, ErrorKind
from neuron_ui.contract.registry import BoundedRegistry
from neuron_ui.contract.stopping import Stopped

if TYPE_CHECKING:
    from neuron_ui.contract.layouts import Layout
    from neuron_ui.contract.stopping import StopToken


SHUTTING_DOWN = "the server is shutting down; try again in a moment"
LEFT_THE_QUEUE = "stopped: you left the queue; no image was made"
REPORT_SECONDS = 1.0  # how often a waiting user hears how long is left
VisitorKey = str | tuple[str, int]  # a visitor's name, or ("anonymous", arrival) for a request that names nobody
REMEMBERED_VISITORS = 4096  # when each was last served; the oldest are forgotten (they rank by when they came)

# The layouts of the requests ahead in the order they go (None: not told), and how many are the caller's own
OnWait = Callable[[list["Layout | None"], int], None]



@dataclass(eq=False)
class Ticket:
    """One waiting request: what it is (`job`, for the waiting words), whose, when it came (`arrival`) and how many
    turns had been given by then (`turns_before`)."""

    job: Layout | None  # None: not told
    visitor: str | None
    arrival: int
    turns_before: int

    @property
    def key(self) -> VisitorKey:
        return self.visitor if self.visitor is not None else ("anonymous", self.arrival)


class Turns:
    """The waiting requests and when each visitor was last served: the order they get the device in."""

    def __init__(self, remembered: int = REMEMBERED_VISITORS) -> None:
        self._waiting: list[Ticket] = []  # in arrival order
        self._last_served: BoundedRegistry[VisitorKey, int] = BoundedRegistry(remembered)  # visitor -> latest turn
        self._clock = 0  # turns given, to anyone (a request without a visitor too)
        self._arrivals = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def join(self, job: Layout | None, visitor: str | None) -> Ticket:
        self._arrivals += 1
        ticket = Ticket(job, visitor, self._arrivals, self._clock)
        self._waiting.append(ticket)
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """A request stopped waiting without a turn (stopped, refused)."""
        if ticket in self._waiting:
            self._waiting.remove(ticket)

    def take(self, ticket: Ticket) -> None:
        """`ticket` gets the device now: it stops waiting and its visitor counts as just served."""
        self._waiting.remove(ticket)
        self._clock += 1
        if ticket.visitor is not None:
            self._last_served[ticket.visitor] = self._clock

    def waiting_for(self, visitor: str | None) -> int:
        """Requests of `visitor` waiting (0 for nobody: a request without a visitor is its own)."""
        return 0 if visitor is None else sum(1 for t in self._waiting if t.visitor == visitor)

    def visitors(self) -> int:
        """How many visitors wait (not who)."""
        return len({t.key for t in self._waiting})

    def first(self) -> Ticket | None:
        """The request that gets the device next: the first one of the visitor whose turn came longest ago."""
        return next(self.order(), None)

    def order(self) -> Iterator[Ticket]:
        """Every waiting request in the order it would get the device if nobody else came: turns played out, as far
        as the caller reads (the first costs one pass over the waiting requests)."""
        queues: dict[VisitorKey, list[Ticket]] = {}
        for ticket in self._waiting:
            queues.setdefault(ticket.key, []).append(ticket)
        last = {key: self._last_served.get(key) for key in queues}
        clock = self._clock
        while queues:
            key = min(queues, key=lambda k: _rank(queues[k][0], last[k]))
            yield queues[key].pop(0)
            clock += 1
            last[key] = clock
            if not queues[key]:
                del queues[key]


def _rank(head: Ticket, last_turn: int | None) -> tuple[int, int]:
    """A visitor's place, from the first of its waiting requests: the later of its last turn and the moment that
    request came (just before the turn given next, hence the half), then the earlier request. Counted in half turns:
    turn n is 2n, coming while n turns had been given is 2n - 1, so it ranks before the visitor served n-th (the
    one on the device) and after everyone served before."""
    came = 2 * head.turns_before - 1
    return (came if last_turn is None else max(2 * last_turn, came)), head.arrival


class DeviceQueue:
    def __init__(self, max_per_visitor: int | None = None, slots: int = 1) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._slots = slots
        self._turns = Turns()
        self._closed = False
        self._background = 0  # background work waiting for the device
        self.max_per_visitor = max_per_visitor

    @property
    def busy(self) -> bool:
        return self._running >= self._slots

    @property
    def waiting(self) -> int:
        """Users waiting for the device (not counting the ones on it)."""
        return len(self._turns)

    @property
    def visitors_waiting(self) -> int:
        """How many visitors wait (each counted once, however many requests they queued)."""
        with self._cond:
            return self._turns.visitors()

    @contextmanager
    def user(self, stop: StopToken | None = None, job: Layout | None = None, on_wait: OnWait | None = None,
             visitor: str | None = None) -> Iterator[None]:
        """Hold the device for a user's request when its visitor's turn comes; a stop leaves the queue. A visitor
        with `max_per_visitor` requests waiting is refused at once (EngineError, kind "visitor_queue_full")."""
        with self._cond:
            if (limit := self.max_per_visitor) and self._turns.waiting_for(visitor) >= limit:
                raise EngineError(f"your own queue is full: {limit} of your requests are already waiting (at most "
                                  f"{limit} per visitor); ask again once one has started",
                                  kind=ErrorKind.VISITOR_QUEUE_FULL)
            ticket = self._turns.join(job, visitor)
        forget = stop.listen(self._wake) if stop is not None else (lambda: None)
        try:
            self._wait_turn(ticket, stop, on_wait)
        finally:
            forget()
            with self._cond:
                self._turns.leave(ticket)  # still waiting only when it did not get the device
                self._cond.notify_all()  # the users behind moved up
        try:
            yield
        finally:
            self._release()

    def _wait_turn(self, ticket: Ticket, stop: StopToken | None, on_wait: OnWait | None) -> None:
        def done() -> bool:
            return (self._closed or (stop is not None and stop.stopped)
                    or (self._running < self._slots and self._turns.first() is ticket))

        while True:
            with self._cond:
                if done():
                    self._refuse_if_closed()
                    if stop is not None and stop.stopped:
                        raise Stopped(LEFT_THE_QUEUE)
                    self._turns.take(ticket)
                    self._running += 1
                    return
                ahead = self._ahead(ticket)
            if on_wait is not None:  # outside the lock: it may take its time (an engine's estimates, a progress bar)
                mine = sum(1 for t in ahead if t.visitor is not None and t.visitor == ticket.visitor)
                on_wait([t.job for t in ahead], mine)
            with self._cond:
                self._cond.wait_for(partial(self._moved, ticket, ahead, done), REPORT_SECONDS)

    def _moved(self, ticket: Ticket, seen: list[Ticket], done: Callable[[], bool]) -> bool:
        return done() or self._ahead(ticket) != seen

    def _ahead(self, ticket: Ticket) -> list[Ticket]:
        return list(takewhile(lambda other: other is not ticket, self._turns.order()))

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    @contextmanager
    def background(self) -> Iterator[None]:
        """Hold the device for background work, only when no user is waiting for it."""
        with self._cond:
            self._background += 1
            try:
                self._cond.wait_for(lambda: self._closed or (self._running < self._slots and not self._turns))
            finally:
                self._background -= 1
            self._refuse_if_closed()
            self._running += 1
        try:
            yield
        finally:
            self._release()

    def close(self, timeout: float) -> bool:
        """Refuse the device to everyone from now on; True once the runs on it (if any) have ended within `timeout`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: not self._running, timeout)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise EngineError(SHUTTING_DOWN, kind=ErrorKind.SHUTTING_DOWN)

    def _release(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()
