"""A browser session that survives a reload: what the browser keeps, and what the server holds for it.

The browser keeps the form and the history in gr.BrowserState (its localStorage), with a session id. A result that
finishes while its page is away (reloaded, closed, a new tab) is held here under that id so the page shows it when
it comes back. Held for HOLD_SECONDS, for at most MAX_SESSIONS sessions of MAX_HELD results each: never unbounded.
A session is held only once the engine has admitted its request (a valid one), and room for a new session is made
only from sessions owed nothing (no request running, no held image still on disk): a flood of requests with new
session ids cannot push out an image another session is owed. Everything the browser sends back is untrusted (the
BrowserState secret is sent to the page): `clean_*` keeps only well-formed values and files inside this app's own
folder, and looks at no more entries than it keeps.
"""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STORAGE_KEY = "neuron-ui-session"
HOLD_SECONDS = 600.0
MAX_SESSIONS = 1024  # above the image store's 512 files and the device's queue (--max-queue up to 500): room for a newcomer
MAX_HELD = 8
ERROR_SECONDS = 10.0  # a failure's line is shown to each of its failure events (a cancel and the error can both fire)
MAX_PATHS = 16  # references or editor layers of one history entry: more than any request takes
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")


def new_session_id() -> str:
    return secrets.token_urlsafe(16)


def session_id(session: Any) -> str | None:
    """The id the browser keeps, if it sent a well-formed one."""
    value = session.get("id") if isinstance(session, dict) else None
    return value if isinstance(value, str) and _SESSION_ID.fullmatch(value) else None


def inside(path: Any, folders: tuple[Path, ...], base: Path) -> str | None:
    """The path of an existing file under one of `folders` (after resolving links and '..'), as named under `base`,
    else None: a path from the browser is served only if the app made it. Gradio sends the paths of files in its own
    folder (`base`, GRADIO_TEMP_DIR) relative to that folder; the images are there through a link (files.py), so the
    path given back is the one under `base`, never the link's target (the gate cuts `base` from answers)."""
    if not isinstance(path, str) or not path or "\x00" in path:
        return None
    full = os.path.normpath(os.path.join(base, path))  # an absolute `path` stays itself
    if not full.startswith(os.path.join(base, "")):
        return None
    try:
        resolved = Path(full).resolve()
        ours = resolved.is_file() and any(resolved.is_relative_to(folder.resolve()) for folder in folders)
    except (OSError, RuntimeError, ValueError):
        return None
    return full if ours else None


def clean_paths(values: Any, folders: tuple[Path, ...], base: Path) -> list[str]:
    paths = [inside(p, folders, base) for p in values[:MAX_PATHS]] if isinstance(values, list) else []
    return [p for p in paths if p]


def clean_made(value: Any) -> float:
    """When an entry was made (time.time()), or 0.0: a forged one must still sort beside the others."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else 0.0


def clean_entry(entry: Any, images: Path, uploads: Path) -> dict[str, Any] | None:
    """A history entry from the browser: its image must be one of ours; edit inputs (uploads, or results used as
    references or edited) are kept only if ours too. A file gone (an image the store dropped, an upload from before
    a restart, a folder of another version) drops the entry, or that input, quietly."""
    inputs = (uploads, images)
    path = inside(entry.get("path"), (images,), uploads) if isinstance(entry, dict) else None
    if path is None or not isinstance(entry.get("seed"), int) or not isinstance(entry.get("resolution"), str):
        return None
    cleaned = {**entry, "path": path, "info": str(entry.get("info", ""))[:2000], "made": clean_made(entry.get("made"))}
    cleaned["references"] = clean_paths(entry.get("references"), inputs, uploads)
    editor = entry.get("editor")
    background = inside(editor.get("background"), inputs, uploads) if isinstance(editor, dict) else None
    if background:
        cleaned["editor"] = {"background": background, "layers": clean_paths(editor.get("layers"), inputs, uploads),
                             "composite": None}
    else:
        cleaned.pop("editor", None)
    return cleaned


def clean_history(history: Any, images: Path, uploads: Path, limit: int) -> list[dict[str, Any]]:
    """The first `limit` entries the browser sent, those well-formed: a megabyte of history costs no more than 24."""
    entries = [clean_entry(e, images, uploads) for e in history[:limit]] if isinstance(history, list) else []
    return [e for e in entries if e is not None]


def merge_history(history: list[dict[str, Any]], held: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """The browser's history with the held results it has not seen, newest first."""
    known = {e["path"] for e in history}
    merged = [e for e in held if e["path"] not in known] + history
    merged.sort(key=lambda e: e.get("made", 0.0), reverse=True)
    return merged[:limit]


@dataclass
class _Held:
    results: list[dict[str, Any]] = field(default_factory=list)  # newest first
    running: str | None = None  # what is being made for this session right now
    touched: float = 0.0

    def owed(self) -> bool:
        """Something the page may still come back for: a request running, or a held image still on disk."""
        return self.running is not None or any(Path(e["path"]).is_file() for e in self.results)


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
        self._sessions: OrderedDict[str, _Held] = OrderedDict()
        self._errors: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._pending: dict[str, int] = {}  # requests of each session in a handler now (bounded by the queue)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._sessions)

    def hold(self, sid: str | None, entry: dict[str, Any]) -> None:
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
                self._errors.pop(sid, None)
                self._errors[sid] = (message, self.clock())
                while len(self._errors) > self.max_sessions:
                    self._errors.popitem(last=False)

    def results(self, sid: str | None) -> list[dict[str, Any]]:
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
        held = self._sessions.pop(sid, None)
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
        spare = next((sid for sid, held in self._sessions.items() if not held.owed()), None)
        if spare is None:
            return False
        del self._sessions[spare]
        return True

    def _expire(self) -> None:
        deadline = self.clock() - self.hold_seconds
        for sid in [sid for sid, held in self._sessions.items() if held.touched < deadline and not held.running]:
            del self._sessions[sid]
