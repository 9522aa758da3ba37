"""Few messages on a replica's stream while its engine runs: at most one progress line every STEP_GAP, the newest,
never later than that, and none at all for an image shorter than the gap; every step preview, in order.

Why: a message sent while the engine's thread runs costs that engine far more than the message's own Python: on the
tiny model one line in the middle of an image made the replica's engine about 2 ms slower (the replica's loop and
gRPC take the GIL the engine needs, and the front's threads wake beside it; docs/performance.md, "Replicas"),
whereas Started, sent as the engine's thread takes the work, cost nothing measurable. A person reads a line at most
about ten times a second. So the engine's thread offers each line here without waking the replica's loop; the loop
sends the line held at its next tick, STEP_GAP after the message before, a newer line replacing an older one (what
it said is over) and the result dropping it. A line that comes STEP_GAP or more after the last message (a Trainium
step of klein-4B, a CPU step of the real model) goes at once, as does one that says the request waits (in the
replica's queue, or while its size compiles): a person waits on those. A step preview is paced as a line is, but a
client counts and shows each one (issue 46: a newer line replaced them all), so none is replaced or dropped: the
previews held go, in order, with whatever sends next (a tick, a line that goes at once, the result: a short
image's previews go just before it, after its engine ended). Where the request went (stopping's phases) rides on
the next line sent (neuron_ui.replicas.deployment).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable

from neuron_ui.replicas.messages import Done, Failed, Progress
from neuron_ui.contract.stopping import Phase

STEP_GAP = 0.1  # seconds: at most this much later than the step it shows does a held line go
WAITS = (Phase.WAITING, Phase.COMPILING)  # a line of these stages goes at once: the person waits on it


class LinePacer:
    """One request's lines between the engine's thread (offer, finish) and the replica's loop (messages)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, gap: float = STEP_GAP,
                 clock: Callable[[], float] = time.monotonic):
        """`clock`: the seconds the gap is counted in (a test's own)."""
        self.gap = gap
        self._loop = loop
        self._clock = clock
        self._queue: asyncio.Queue[Progress | Done | Failed] = asyncio.Queue()
        self._lock = threading.Lock()  # held, previews, last_sent: the engine's thread and the loop both set them
        self._held: Progress | None = None  # the newest line
        self._previews: list[Progress] = []  # every preview not yet sent, oldest first
        self._last_sent = clock()  # the gap counts from now: Started goes as the engine's thread takes the work

    def offer(self, line: Progress) -> None:
        """From the engine's thread: send the line at once (it says the request waits, or the gap is up), with the
        previews held before it, else hold it: a preview after those held, a line in place of the one held."""
        with self._lock:
            now = self._clock()
            if line.update.stage in WAITS or now - self._last_sent >= self.gap:
                self._held, self._last_sent = None, now  # the newer line says more than the one held
                self._send([*self._take_previews(), line])
            elif line.png is not None:
                self._previews.append(line)
            else:
                self._held = line

    def finish(self, result: Done | Failed) -> None:
        """From the engine's thread, after its last line: the previews held, then the result, which drops the line
        held."""
        with self._lock:
            self._held = None
            self._send([*self._take_previews(), result])

    def _take_previews(self) -> list[Progress]:
        previews, self._previews = self._previews, []
        return previews

    def _send(self, messages: list[Progress | Done | Failed]) -> None:
        """Queued for the loop in one wake-up, in order."""
        def put() -> None:
            for message in messages:
                self._queue.put_nowait(message)

        self._loop.call_soon_threadsafe(put)

    async def messages(self) -> AsyncIterator[Progress | Done | Failed]:
        """On the loop: the lines as they go, then the result, the last one. The loop ticks once the gap since the
        last message is up (else a gap later): the previews and the line held go then. Nothing ticks once the result
        went, or the front stopped reading (else ticks would go on until the engine ends, a whole compile for a
        warm-up)."""
        while True:
            with self._lock:
                wait = max(self._last_sent + self.gap - self._clock(), 0.0) or self.gap
            try:
                message = await asyncio.wait_for(self._queue.get(), wait)  # a get cut short leaves its message queued
            except asyncio.TimeoutError:  # the tick
                with self._lock:
                    now = self._clock()
                    if (self._held is None and not self._previews) or now - self._last_sent < self.gap:
                        continue
                    held = [*self._take_previews(), *([self._held] if self._held else [])]
                    self._held, self._last_sent = None, now
                for line in held:
                    yield line
                continue
            yield message
            if isinstance(message, (Done, Failed)):
                return
