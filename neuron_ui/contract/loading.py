"""What the process does before it serves (fetching a compile cache, ...), for /healthz's loading answer."""

from __future__ import annotations

import threading


class LoadingState:
    """One phase with its byte counts: the start-up thread writes it, the HTTP server's /healthz reads it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase: dict = {}

    def set(self, phase: str, done_bytes: int | None = None, total_bytes: int | None = None) -> None:
        with self._lock:
            self._phase = {"phase": phase, "done_bytes": done_bytes, "total_bytes": total_bytes}

    def clear(self) -> None:
        with self._lock:
            self._phase = {}

    def body(self) -> dict:
        """`{"status": "loading"}`, with `phase`, `done_bytes` and `total_bytes` (null when unknown) during a phase."""
        with self._lock:
            return {"status": "loading", **self._phase}
