"""The one count of the device's work against --max-queue: the one on the device plus those waiting, over every door.

Gradio's device events are counted by Gradio's queue (`events`, handed in once the demo is mounted); the MCP tools'
calls are counted here while they run. The gate asks `refusal` for a Gradio request before it reaches the queue (with
the requests it has let through and Gradio has not queued yet), the MCP endpoint holds `admitted` around its call:
one bound, one message, one count.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from neuron_ui.contract.errors import EngineError, ErrorKind


class Admission:
    """Admits device work up to --max-queue waiting plus the one on the device."""

    def __init__(self, max_queue: int, events: Callable[[], int] = lambda: 0):
        self.max_queue = max_queue
        self.events = events  # Gradio's device events accepted and not finished (0 until the demo is mounted)
        self.calls = 0  # MCP's device calls running
        self._lock = threading.Lock()

    def count(self) -> int:
        """Device requests accepted and not finished, Gradio's and MCP's."""
        return self.events() + self.calls

    def refusal(self, arriving: int = 0) -> str | None:
        """The one line a new request is refused with while the queue is full (`arriving`: let through, not yet
        counted); None when it may wait."""
        admitted = self.count() + arriving
        if admitted > self.max_queue:
            return f"Queue is full: {admitted - 1} requests are waiting for the device; try again in a moment"
        return None

    @contextmanager
    def admitted(self) -> Iterator[None]:
        """Count one call while it runs; EngineError (one line) when the queue is full."""
        with self._lock:
            if (line := self.refusal()) is not None:
                raise EngineError(line, kind=ErrorKind.QUEUE_FULL)
            self.calls += 1
        try:
            yield
        finally:
            with self._lock:
                self.calls -= 1
