"""Few messages on a replica's stream: at most one progress line every STEP_GAP, the newest, never later than that.

Why: each message of a stream costs the replica's event loop some 0.3 ms of Python (Serve's wrappers, the gRPC
write) while holding the GIL its engine thread also needs, and the front as much to read it. On the tiny model's
16 ms steps, the four step lines and the decoding line slowed the replica's engine by about 1.6 ms an image against
the same engine with none (docs/performance.md, "Replicas"). A person reads a line at most about ten times a second,
so a line that comes within STEP_GAP of the line last sent waits; a newer line replaces it (what it said is
over); it goes when the gap is up, unless the result came first. A line that says where the request went (queued,
compiling, running: what a Stop would save) goes at once. On a device whose steps take longer than the gap (a
Trainium step of klein-4B, a CPU step of the real model) every line goes at once, as before.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from neuron_ui.replicas.messages import Done, Failed, Preview, Progress

STEP_GAP = 0.1  # seconds: at most this much later than the step it shows does a held line go


@dataclass(frozen=True)
class GapUp:
    """Put on the queue by the loop's timer: the gap after the line last sent is up (for hold number `hold`)."""

    hold: int


Line = Progress | Preview | Done | Failed  # what the engine's thread puts on the queue: its lines, then the result


async def paced(queue: asyncio.Queue[Line | GapUp], urgent: Callable[[], bool] = lambda: False,
                gap: float = STEP_GAP) -> AsyncIterator[Line]:
    """The queue's messages up to the result (Done or Failed, the last one yielded), paced as the module says;
    `urgent()` true sends a line at once (where the request is changed: the front must know it now)."""
    loop = asyncio.get_running_loop()
    held: Progress | Preview | None = None
    holds = 0  # each hold's number: a timer for a hold since sent or dropped finds another number
    last_sent = -math.inf
    while True:
        message = await queue.get()
        if isinstance(message, GapUp):
            if held is None or message.hold != holds:
                continue  # that hold was dropped
            message, held = held, None
        elif isinstance(message, (Progress, Preview)) and loop.time() - last_sent < gap and not urgent():
            if held is None:
                holds += 1
                loop.call_at(last_sent + gap, queue.put_nowait, GapUp(holds))
            held = message
            continue
        else:
            held = None  # the result, or a line sent at once: it says more than the line held
        if isinstance(message, (Progress, Preview)):
            last_sent = loop.time()
        yield message
        if isinstance(message, (Done, Failed)):
            return
