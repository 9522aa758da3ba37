"""A browser session that survives a reload: what the browser keeps, and what the server holds for it.

The browser keeps the form and the history in gr.BrowserState (its localStorage), with a session id. A result that
finishes while its page is away (reloaded, closed, a new tab) is held here under that id so the page shows it when
it comes back. Held for HOLD_SECONDS, for at most MAX_SESSIONS sessions of MAX_HELD results each: never unbounded.
A session is held only once the engine has admitted its request (a valid one), and room for a new session is made
only from sessions owed nothing (no request running, no held image still on disk): a flood of requests with new
session ids cannot push out an image another session is owed. Everything the browser sends back is untrusted (the
BrowserState secret is sent to the page): its history is read by ui/history.py.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from neuron_ui.contract.registry import BoundedRegistry
from neuron_ui.studio.grid_plan import DEFAULT_MAX_CELLS

if TYPE_CHECKING:
    from neuron_ui.ui.history import HistoryEntry

logger = logging.getLogger(__name__)

STORAGE_KEY = "neuron-ui-session"
HOLD_SECONDS = 600.0
MAX_SESSIONS = 1024  # above the image store's 512 files and the device's queue (--max-queue up to 500)
MAX_HELD = DEFAULT_MAX_CELLS  # a grid of the default size that finished while its page was away comes back whole
ERROR_SECONDS = 10.0  # a failure's line is shown to each of its failure events (a cancel and the error can both fire)
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")


class BrowserSession(TypedDict, total=False):
    """The page's gr.BrowserState value as the browser sends it back: untrusted, each field checked where it is read
    (session_id, SessionEvents._restore_form, clean_history)."""

    id: str
    prompt: str
    resolution: str
    steps: float
    seed: float | None
    randomize: bool
    guidance: float
    history: list[dict[str, object]]


def new_session_id() -> str:
    return secrets.token_urlsafe(16)


def session_id(session: BrowserSession | None) -> str | None:
    """The id the browser keeps, if it sent a well-formed one."""
    value = session.get("id") if isinstance(session, dict) else None
    return value if isinstance(value, str) and _SESSION_ID.fullmatch(value) else None


@dataclass
class _Held:
    results: list[HistoryEntry] = field(default_factory=list)  # newest first
    running: str | None = None  # what is being made for this session right now
    touched: float = 0.0

    def owed(self) -> bool:
        """Something the page may still come back for: a request running, or a held image still on disk."""
        return self.running is not None or any(Path(e.path).is_file() for e in self.results)


class HeldResults:
    """Results and the request in progress of each browser session, bounded in time and count, and the last error
    of each (a line for the page right after the failure, kept apart: an error never takes a session's room).

    A stopped image's failure reaches the page twice and in any order (the Stop's cancel and the request's own
    error, issue 22): the error line is read, not taken, for ERROR_SECONDS, and `settled` says when the session's
    requests in this process have all ended, so the line waits for the reason instead of racing it."""

    def __init__(self, hold_seconds: float = HOLD_SECONDS, max_sessions: int = MAX_SESSIONS,
                 max_held: int = MAX_HELD, clock: Callable[[], float] = time.monotonic):
        self.hold_seconds = hold_seconds
        self.max_sessions = max_sessions
        self.max_held = max_held
        self.clock = clock
        # sessions are never dropped by the registry's own bound: _make_room keeps room, sparing sessions owed results
        self._sessions: BoundedRegistry[str, _Held] = BoundedRegistry(max_sessions)
        self._errors: BoundedRegistry[str, tuple[str, float]] = BoundedRegistry(max_sessions)
        self._pending: dict[str, int] = {}  # requests of each session in a handler now (bounded by the queue)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._sessions)

    def hold(self, sid: str | None, entry: HistoryEntry) -> None:
        with self._lock:
            if held := self._touch(sid):
                held.results = [entry, *held.results][: self.max_held]
                held.running = None

    def start(self, sid: str | None, what: str) -> None:
        """The engine admitted a request of this session (it is valid and waits for the device, or runs)."""
        with self._lock:
            if held := self._touch(sid):
                held.running = what

    def fail(self, sid: str | None, message: str) -> None:
        with self._lock:
            held = self._sessions.get(sid) if sid else None
            if held is not None:
                held.running = None
            if sid:
                self._errors[sid] = (message, self.clock())  # the most recent; the least recent past the bound go

    def results(self, sid: str | None) -> list[HistoryEntry]:
        with self._lock:
            self._expire()
            held = self._sessions.get(sid) if sid else None
            return list(held.results) if held else []

    def running(self, sid: str | None) -> str | None:
        with self._lock:
            self._expire()
            held = self._sessions.get(sid) if sid else None
            return held.running if held else None

    def begin(self, sid: str | None) -> None:
        """A handler starts a request for the session: the last error is history now."""
        if sid:
            with self._lock:
                self._errors.pop(sid, None)
                self._pending[sid] = self._pending.get(sid, 0) + 1

    def end(self, sid: str | None) -> None:
        if sid:
            with self._lock:
                left = self._pending.get(sid, 0) - 1
                if left > 0:
                    self._pending[sid] = left
                else:
                    self._pending.pop(sid, None)

    def settled(self, sid: str | None) -> bool:
        """No request of the session is in a handler, or one has already failed (its reason is known)."""
        with self._lock:
            return not sid or sid not in self._pending or sid in self._errors

    def error(self, sid: str | None) -> str | None:
        """The session's last error, if recent (see the class docstring)."""
        with self._lock:
            message, when = self._errors.get(sid, (None, 0.0)) if sid else (None, 0.0)
            return message if message is not None and self.clock() - when <= ERROR_SECONDS else None

    def _touch(self, sid: str | None) -> _Held | None:
        """The session's entry, made the most recent; a new one only where there is room (see _make_room)."""
        if not sid:
            return None
        self._expire()
        held = self._sessions.use(sid)
        if held is None:
            if not self._make_room():
                logger.warning("%d browser sessions are owed results: a new one is not held", len(self._sessions))
                return None
            held = _Held()
        held.touched = self.clock()
        self._sessions[sid] = held  # the most recent last
        return held

    def _make_room(self) -> bool:
        """Room for one more session: the least recent one owed nothing goes; a session owed a result never does."""
        if len(self._sessions) < self.max_sessions:
            return True
        spare = next((sid for sid in self._sessions if not self._sessions[sid].owed()), None)
        if spare is None:
            return False
        self._sessions.pop(spare)
        return True

    def _expire(self) -> None:
        deadline = self.clock() - self.hold_seconds
        for sid in [sid for sid in self._sessions if (held := self._sessions[sid]).touched < deadline
                    and not held.running]:
            self._sessions.pop(sid)
