"""Where one request's time went between the front and its replica: monotonic stamps taken on both sides (the
replica's travel in its stream messages, neuron_ui.replicas.messages), turned into named stages. Cheap enough for
every request (a clock read per stamp, no logging); read by whoever listens (bench/replicas.py).

The stamps are time.monotonic() on both sides, one clock per host on Linux (CLOCK_MONOTONIC): stages that cross the
processes (the handle call, the first message, the transfers) mean something only with the replica on the front's
host, as in the bench; the others are measured on one side.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

# The stages of one image in order; each stage's figure is seconds (stages() says how each is measured).
STAGES = ("front_turn", "front_send", "handle_call", "replica_queue", "engine", "replica_after", "transfer",
          "front_after")


def now() -> float:
    """The stamps' clock, the same in the front and the replica (one host)."""
    return time.monotonic()


@dataclass
class Timing:
    """One request's stamps, filled as it goes: the front's (called ... returned) and its replica's (received ...
    done_sent, carried by Started and Done). Zero: not reached (a stamp an older replica does not send)."""

    called: float = 0.0  # front: the client was asked for the image
    turn: float = 0.0  # front: its turn came (the front's queue)
    sent: float = 0.0  # front: the handle was called
    received: float = 0.0  # replica: its method began (Started)
    began: float = 0.0  # replica: the engine's work began (Done)
    ended: float = 0.0  # replica: ... and ended (Done)
    done_sent: float = 0.0  # replica: Done left the replica
    done_read: float = 0.0  # front: Done arrived, the image unpickled
    returned: float = 0.0  # front: the stream ended, the result goes back to the caller
    step_trips: list[float] = field(default_factory=list)  # each progress message's trip, replica to front
    messages: int = 0  # messages the stream carried

    def stages(self) -> dict[str, float]:
        """Seconds per stage (STAGES), in the order the image passes them, adding up to total:

        front_turn     called -> turn        checks, and waiting for a turn at the front (DeviceQueue)
        front_send     turn -> sent          the handle's options and its remote() call
        handle_call    sent -> received      Serve's router, the call's trip and the replica's own queue, until
                                             the replica's method began
        replica_queue  received -> began     on the replica before the engine: the shape's lease, Started sent,
                                             the worker thread started
        engine         began -> ended        the engine's own work (compare the in-process engine's time)
        replica_after  ended -> done_sent    the result wrapped, the compile messages sent
        transfer       done_sent -> done_read  the result's (the image's) pickle, transfer and unpickle
        front_after    done_read -> returned   the stream read to its end, the result logged and returned
        """
        marks = (self.called, self.turn, self.sent, self.received, self.began, self.ended, self.done_sent,
                 self.done_read, self.returned)
        return {name: round(later - earlier, 6) for name, earlier, later in zip(STAGES, marks, marks[1:])}

    def total(self) -> float:
        return self.returned - self.called

    def overhead(self) -> float:
        """Everything but the engine's own work: what serving through a replica added to this image."""
        return self.total() - (self.ended - self.began)

    def step_trip(self) -> float | None:
        """The median trip of a progress message from the replica to the front, or None without any."""
        if not self.step_trips:
            return None
        trips = sorted(self.step_trips)
        return trips[len(trips) // 2]


class StartupStages:
    """Seconds per stage of a start-up, each from the end of the one before: mark() ends a stage."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self._last = clock()

    def mark(self, stage: str) -> float:
        """The stage that ends now; its seconds."""
        at = self.clock()
        self.seconds[stage] = round(at - self._last, 3)
        self._last = at
        return self.seconds[stage]
