"""A browser session that survives a reload: what the browser keeps, what the server holds for it, what a reload or a
new tab finds, and who asks for an event.

The browser keeps the form and the history in gr.BrowserState (its localStorage), with a session id: an object of its
own beside the form's (ui/handlers.py). A result that finishes while its page is away (reloaded, closed, a new tab) is
held here under that id so the page shows it when it comes back. Held for HOLD_SECONDS, for at most MAX_SESSIONS
sessions of MAX_HELD results each: never unbounded. A session is held only once the engine has admitted its request (a
valid one), and room for a new session is made only from sessions owed nothing (no request running, no held image
still on disk): a flood of requests with new session ids cannot push out an image another session is owed.
Everything the browser sends back is untrusted (the BrowserState secret is sent to the page): its history is read by
ui/history.py, its form with the request's own checks (contract.requests).
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import gradio as gr

from neuron_ui.contract.registry import BoundedRegistry
from neuron_ui.contract.requests import GUIDANCE, MAX_PROMPT_CHARS, SEED, STEPS
from neuron_ui.studio.grid_plan import DEFAULT_MAX_CELLS
from neuron_ui.studio.studio import Asker
from neuron_ui.ui.history import HistoryEntry, clean_history, gallery_items, merge_history
from neuron_ui.web.gradio_bridge import current_event, current_user
from neuron_ui.web.visitors import visitor_name

if TYPE_CHECKING:
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.web.files import ImageStore

logger = logging.getLogger(__name__)

STORAGE_KEY = "neuron-ui-session"
HOLD_SECONDS = 600.0
MAX_SESSIONS = 1024  # above the image store's 512 files and the device's queue (--max-queue up to 500)
MAX_HELD = DEFAULT_MAX_CELLS  # a grid of the default size that finished while its page was away comes back whole
ERROR_SECONDS = 10.0  # a failure's line is shown to each of its failure events (a cancel and the error can both fire)
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")
HISTORY_SIZE = 24
FORM_FIELDS = ("prompt", "resolution", "steps", "seed", "randomize", "guidance")  # kept in the browser


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


def session_id(session: BrowserSession | None) -> str | None:
    """The id the browser keeps, if it sent a well-formed one."""
    value = session.get("id") if isinstance(session, dict) else None
    return value if isinstance(value, str) and _SESSION_ID.fullmatch(value) else None


def current_visitor(browser_session: BrowserSession | None = None) -> str | None:
    """The visitor of the event this handler runs for (web/visitors.py names visitors: a login, a browser or a
    session); `browser_session` is the page's BrowserState, if any."""
    return visitor_name(current_user(), session_id(browser_session), current_event()[0])


def asker(browser_session: BrowserSession | None = None, **hearing: Any) -> Asker:
    """The studio's Asker for the event this handler runs for: its visitor, and its Gradio session and event, which
    key the call's stop token (the page's Stop, /stop, a client's cancel or disconnect find it); `hearing`: what
    hears the call (progress, on_admitted, on_preview)."""
    session, event = current_event()
    return Asker(current_visitor(browser_session), session, event, **hearing)


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
        self.hold_seconds, self.max_sessions, self.max_held, self.clock = hold_seconds, max_sessions, max_held, clock
        # sessions are never dropped by the registry's own bound: _make_room keeps room, sparing sessions owed results
        self._sessions: BoundedRegistry[str, _Held] = BoundedRegistry(max_sessions)
        self._errors: BoundedRegistry[str, tuple[str, float]] = BoundedRegistry(max_sessions)
        self._pending: Counter[str] = Counter()  # requests of each session in a handler now (bounded by the queue)
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
        if sid:
            with self._lock:
                if (held := self._sessions.get(sid)) is not None:
                    held.running = None
                self._errors[sid] = (message, self.clock())  # the most recent; the least recent past the bound go

    def results(self, sid: str | None) -> list[HistoryEntry]:
        return list(held.results) if (held := self._find(sid)) else []  # hold() replaces the list, never changes it

    def running(self, sid: str | None) -> str | None:
        return held.running if (held := self._find(sid)) else None

    def _find(self, sid: str | None) -> _Held | None:
        with self._lock:
            self._expire()
            return self._sessions.get(sid) if sid else None

    def begin(self, sid: str | None) -> None:
        """A handler starts a request for the session: the last error is history now."""
        if sid:
            with self._lock:
                self._errors.pop(sid, None)
                self._pending[sid] += 1

    def end(self, sid: str | None) -> None:
        if sid:
            with self._lock:
                self._pending -= Counter({sid: 1})  # a count that reaches 0 goes

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


class SessionEvents:
    """Restore on page load, save on every change, collect what finished meanwhile; the form's fields are checked
    with the request's own checks (contract.requests), the browser's copy being untrusted."""

    def __init__(self, engine: EngineLike, store: ImageStore, held: HeldResults, uploads: Path):
        self.engine, self.store, self.held = engine, store, held
        self.uploads = uploads  # the only files a browser's session may name

    def on_restore(self, session: BrowserSession | None):
        """On page load: the form and history the browser kept, with the results that finished while it was away;
        the newest image shows. Outputs: session, prompt, resolution, steps, seed, randomize, guidance, history,
        history gallery, image, info, and the collect timer: active while a request from before the load runs."""
        saved: BrowserSession = session if isinstance(session, dict) else BrowserSession()
        sid = session_id(saved) or secrets.token_urlsafe(16)
        kept = clean_history(saved.get("history"), self.store.folder, self.uploads, HISTORY_SIZE)
        history = merge_history(kept, self.held.results(sid), HISTORY_SIZE)
        self.store.keep_using(e.path for e in history)  # shown again: the store's bound spares them longest
        arrived = [e for e in history if e not in kept]
        form = self._restore_form(saved)
        if arrived:
            form["seed"] = arrived[0].seed  # the seed box shows the seed of the image shown
        image, info = (history[0].path, history[0].info) if history else (gr.skip(), gr.skip())
        running = self.held.running(sid)
        if running:
            info = (f"*Your image at {running} is still being made (asked for before this page loaded); "
                    "it shows here when it is done.*")
        new_session = {**{k: saved.get(k) for k in FORM_FIELDS}, "id": sid, "history": [e.to_json() for e in history]}
        return (new_session, *(form.get(k, gr.skip()) for k in FORM_FIELDS), history, gallery_items(history), image,
                info, gr.Timer(active=bool(running)))

    def _restore_form(self, saved: BrowserSession) -> dict[str, object]:
        """The form fields the browser kept, each only if well-formed (the browser's copy is untrusted)."""
        presets = [str(p) for p in self.engine.presets]
        checks = {
            "prompt": lambda v: isinstance(v, str) and len(v) <= MAX_PROMPT_CHARS,
            "resolution": lambda v: v in presets,
            "steps": STEPS.accepts,
            "seed": lambda v: v is None or SEED.accepts(v),
            "randomize": lambda v: isinstance(v, bool),
            "guidance": GUIDANCE.accepts,
        }
        return {k: saved.get(k) for k, check in checks.items() if k in saved and check(saved.get(k))}

    def on_save(self, session: BrowserSession | None, prompt: str, resolution: str, steps: float, seed: float | None,
                randomize: bool, guidance: float, history: list[HistoryEntry]) -> object:
        """The form and history into the browser's storage, under the session's id (given by on_restore: a change
        before it is not saved, or it would save under another id); the history's images count as shown. The history
        kept is the page's merged with the browser's copy: a page whose in-page state Gradio dropped (it keeps at most
        GradioLimits.sessions, web/gradio_mount.py) starts its history over, and must not overwrite the older entries
        (their files still on disk) with its new image alone."""
        sid = session_id(session)
        if sid is None:
            return gr.skip()
        stored = clean_history((session or {}).get("history"), self.store.folder, self.uploads, HISTORY_SIZE)
        history = merge_history(history, stored, HISTORY_SIZE)
        self.store.keep_using(e.path for e in history)
        values = dict(zip(FORM_FIELDS, (prompt, resolution, steps, seed, randomize, guidance)))
        return {**values, "id": sid, "history": [e.to_json() for e in history]}

    def on_collect(self, session: BrowserSession | None, history: list[HistoryEntry]):
        """The collect timer's tick, active only while the page awaits a request from before its load (it reloaded
        while the image was being made; an event that outputs to the image, even skipped, takes its progress display
        away from a request that runs): once done, the results the page has not shown are shown and the timer stops.
        Outputs: image, info, seed, history, gallery, the timer."""
        sid = session_id(session)
        known = {e.path for e in history}
        arrived = [e for e in self.held.results(sid) if e.path not in known and Path(e.path).is_file()]
        if not arrived:
            still = self.held.running(sid) is not None  # else it failed, or nothing was asked: stop waiting
            return (*(gr.skip(),) * 5, gr.skip() if still else gr.Timer(active=False))
        history = merge_history(history, arrived, HISTORY_SIZE)
        newest = arrived[0]
        return newest.path, newest.info, newest.seed, history, gallery_items(history), gr.Timer(active=False)
