"""Whose request goes next: visitors take turns. Among the requests waiting, the next one is the first request of
the visitor whose turn came longest ago; each visitor's own requests keep their order.

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

Plain bookkeeping, no threads or locks: DeviceQueue (one device) and the replicas' front (N replicas) hold it under
their own lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from neuron_ui.contract.registry import BoundedRegistry

if TYPE_CHECKING:
    from neuron_ui.contract.layouts import Layout

VisitorKey = str | tuple[str, int]  # a visitor's name, or ("anonymous", arrival) for a request that names nobody
REMEMBERED_VISITORS = 4096  # when each was last served; the oldest are forgotten (they rank by when they came)


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
        heads: dict[VisitorKey, Ticket] = {}
        for ticket in self._waiting:
            heads.setdefault(ticket.key, ticket)
        return min(heads.values(), key=lambda t: _rank(t, self._last_served.get(t.key)), default=None)

    def order(self) -> list[Ticket]:
        """Every waiting request in the order it would get the device if nobody else came: turns played out."""
        queues: dict[VisitorKey, list[Ticket]] = {}
        for ticket in self._waiting:
            queues.setdefault(ticket.key, []).append(ticket)
        last = {key: self._last_served.get(key) for key in queues}
        clock, ordered = self._clock, []
        while queues:
            key = min(queues, key=lambda k: _rank(queues[k][0], last[k]))
            ordered.append(queues[key].pop(0))
            clock += 1
            last[key] = clock
            if not queues[key]:
                del queues[key]
        return ordered


def _rank(head: Ticket, last_turn: int | None) -> tuple[int, int]:
    """A visitor's place, from the first of its waiting requests: the later of its last turn and the moment that
    request came (just before the turn given next, hence the half), then the earlier request. Counted in half turns:
    turn n is 2n, coming while n turns had been given is 2n - 1, so it ranks before the visitor served n-th (the
    one on the device) and after everyone served before."""
    came = 2 * head.turns_before - 1
    return (came if last_turn is None else max(2 * last_turn, came)), head.arrival
