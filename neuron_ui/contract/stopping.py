"""Stopping a request: one StopToken per request, and the tokens of each Gradio session.

A Stop button, the /stop endpoint, a cancelled gradio_client job and a browser that goes away all end in
StopToken.stop(); the engine reads the token where it can act on it: in the device's queue (the request leaves
it), after a compilation (a compile cannot be cut short: the size is ready, the image is not made) and at the
end of every denoising step (the pipeline stops there, before the VAE decode). No torch and no Gradio here:
the UI and the engine both use it.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from neuron_ui.contract.errors import EngineError, ErrorKind, Kind
from neuron_ui.contract.registry import BoundedRegistry

# Where a request is when a stop reaches it. RECEIVED: not yet checked; the engine enters QUEUED once the request
# is valid (admitted), and a stop before then is told as a stop in the queue (the request never reaches it).
class Phase(Kind):
    """Every state a request or a layout passes through, one word each ("compiling" once for all): where a request
    is when a stop reaches it (the stop's JSON answer); what holds the device (COMPILING or RUNNING,
    engine.waiting) and what a wait for a graph is (COMPILING, or LOADING it from the disk cache: engine.graphs'
    claim, a progress update's `phase`), a request's stop phase being COMPILING for a load too: neither can be cut
    short; a progress line's stage (results.Stage) and a shape's state (results.ShapeState)."""

    RECEIVED = "received"
    QUEUED = "queued"
    WAITING = "waiting"
    COLD = "cold"
    COMPILING = "compiling"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    RUNNING = "running"
    DENOISING = "denoising"
    DECODING = "decoding"
    DONE = "done"


class StopReason(Kind):
    """Why a request was stopped: a Stop (the button, /stop), a cancelled Gradio job, or its page gone away."""

    STOPPED_BY_USER = "stopped"
    CANCELLED = "cancelled"
    DISCONNECTED = "disconnected"


MAX_ON_BEHALF = 1024  # stop calls made for another session and not yet run


class Stopped(EngineError):
    """The request was stopped before its image was made; the message says what happened instead."""

    def __init__(self, message: str):
        super().__init__(message, kind=ErrorKind.STOPPED)


class StopToken:
    """One request's stop signal: set from any thread, read by the engine between steps."""

    def __init__(self, event_id: str | None = None, on_admitted: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._listeners: list[Callable[[], None]] = []
        self.event_id = event_id  # the Gradio event it serves, so a cancel of that one event finds it
        self.phase: Phase = Phase.RECEIVED
        self.reason: StopReason | None = None
        self._on_admitted = on_admitted  # called once, when the engine has checked the request and queues it

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self, reason: StopReason = StopReason.STOPPED_BY_USER) -> Phase:
        """Ask the request to stop; returns its phase then (what the stop can still save)."""
        with self._lock:
            if self.phase == Phase.DONE:
                return Phase.DONE
            if not self._stopped.is_set():
                self.reason = reason
                self._stopped.set()
            listeners, phase = list(self._listeners), self.phase
        for listener in listeners:
            listener()
        return Phase.QUEUED if phase == Phase.RECEIVED else phase

    def enter(self, phase: Phase) -> None:
        """The engine says where the request is now; leaving RECEIVED (for anything but DONE) admits it."""
        with self._lock:
            admitted = self.phase == Phase.RECEIVED and phase not in (Phase.RECEIVED, Phase.DONE)
            self.phase = phase
        if admitted and self._on_admitted is not None:  # once: nothing enters RECEIVED again
            self._on_admitted()

    def listen(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call `listener` on stop (e.g. to wake the device's queue); returns what removes it."""
        with self._lock:
            self._listeners.append(listener)

        def remove() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return remove


class SessionStops:
    """The live tokens of each Gradio session (one per page load, or one per gradio_client Client).

    A session hash is random and known only to its browser or client, so a session can stop only its own
    requests. Bounded: a token is held only while its request runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[str, list[StopToken]] = {}
        # a stop call's own session -> the one it stops
        self._on_behalf: BoundedRegistry[str, str] = BoundedRegistry(MAX_ON_BEHALF)

    def on_behalf(self, session: str) -> str:
        """A session id of its own for a stop call that names `session` (a raw POST /call/stop): its answer then
        goes to its own event stream, not to the stream the stopped session's client reads, where the two raced
        for each other's answers. stop() with this id stops `session`, once."""
        own = f"stop-{secrets.token_hex(12)}"
        with self._lock:
            self._on_behalf[own] = session
        return own

    @contextmanager
    def track(self, session: str | None, event_id: str | None = None,
              on_admitted: Callable[[], None] | None = None) -> Iterator[StopToken]:
        """A token for one request of `session` (Gradio event `event_id`), findable by stop() until it ends;
        `on_admitted` runs once the engine has checked the request (StopToken.enter)."""
        token = StopToken(event_id, on_admitted)
        key = session or ""
        with self._lock:
            self._tokens.setdefault(key, []).append(token)
        try:
            yield token
        finally:
            token.enter(Phase.DONE)
            with self._lock:  # only here is a token removed: it is still in its session's list
                self._tokens[key].remove(token)
                if not self._tokens[key]:
                    del self._tokens[key]

    def stop(self, session: str | None, reason: StopReason = StopReason.STOPPED_BY_USER,
             event_id: str | None = None) -> list[Phase]:
        """Stop every running request of `session` (only event `event_id`'s when given); the phases they were in.

        A browser that goes away while its size compiles does not stop the image: the compile cannot be cut
        short anyway, and the image (a step's cost next to the compile's) is kept for the page when it reloads."""
        if not session:
            return []
        with self._lock:
            session = self._on_behalf.pop(session, session)
            tokens = [t for t in self._tokens.get(session, []) if event_id is None or t.event_id == event_id]
        return [token.stop(reason) for token in tokens
                if not (reason == StopReason.DISCONNECTED and token.phase == Phase.COMPILING)]
