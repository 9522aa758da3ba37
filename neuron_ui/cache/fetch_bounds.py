"""The time a download may take, whatever the server does: an overall deadline and a minimum rate a drip cannot pass.

httpx's read timeout bounds only the silence between two reads, so a server sending one byte every few seconds (in
the body, or in the headers) would hold a download, and the app's start-up, for as long as it liked. A watchdog
thread checks the clock instead: past the deadline, or below the minimum rate over a window, it records why and shuts
the connection's socket down, which ends the read under way at once. The socket is learnt from httpcore's `trace`
extension (documented by httpx: "connection.connect_tcp.complete" and "connection.start_tls.complete" carry the
stream, whose get_extra_info("socket") is the socket; read from httpx 0.28 and httpcore 1.0).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from neuron_ui.cache.admin import human_bytes

STREAM_EVENTS = ("connection.connect_tcp.complete", "connection.start_tls.complete")


class Watchdog:
    """Ends a try of a download past `deadline` seconds from `started` (the download's start; by default now), or
    below `min_rate` bytes/s over any `window` seconds of the try.

    `reason` says which, in words for the one line the user reads; the fetch checks it after every try."""

    def __init__(self, deadline: float, min_rate: float, window: float, clock: Callable[[], float] = time.monotonic,
                 started: float | None = None):
        self.deadline, self.min_rate, self.window, self.clock = deadline, min_rate, window, clock
        self.started = clock() if started is None else started
        self.reason: str | None = None
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._window_start, self._window_bytes = clock(), 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="bundle-fetch-watchdog")

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's trace callback: keeps the socket of the connection being read, to end it from here."""
        if event in STREAM_EVENTS:
            with self._lock:
                self._socket = info["return_value"].get_extra_info("socket")
                ended = self.reason is not None
            if ended:  # a connection opened after the end (a redirect's): ended as well
                self._shut()

    def got(self, size: int) -> None:
        with self._lock:
            self._window_bytes += size

    def remaining(self) -> float:
        return self.deadline - (self.clock() - self.started)

    def _watch(self) -> None:
        tick = min(1.0, self.window / 4, self.deadline / 4)
        while not self._done.wait(tick):
            reason = self.check()
            if reason is not None:
                with self._lock:
                    self.reason = reason
                self._shut()
                return

    def check(self) -> str | None:
        """One look at the clock (the watchdog's thread looks every tick): why to end the download, or None."""
        now = self.clock()
        if now - self.started >= self.deadline:
            return f"not done within {self.deadline:g} s (--cache-bundle-deadline)"
        with self._lock:
            span = now - self._window_start
            if span < self.window:
                return None
            got, self._window_start, self._window_bytes = self._window_bytes, now, 0
        if got < self.min_rate * span:
            return (f"too slow: {human_bytes(got)} in {round(span, 1):g} s, under the minimum "
                    f"{human_bytes(int(self.min_rate))}/s (--cache-bundle-min-rate)")
        return None

    def _shut(self) -> None:
        with self._lock:
            sock = self._socket
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns at once; httpx then closes it
            except OSError:  # already closed
                pass
