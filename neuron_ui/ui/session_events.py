"""The browser session's events: what a reload or a new tab finds (the form, the history, the results that finished
while the page was away), and what the browser keeps: an object of its own beside the form's (ui/handlers.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import gradio as gr

from neuron_ui.contract.requests import GUIDANCE, MAX_PROMPT_CHARS, SEED, STEPS
from neuron_ui.ui import session as sessions
from neuron_ui.ui.session import BrowserSession
from neuron_ui.ui.history import HistoryEntry, clean_history, gallery_items, merge_history, to_json

if TYPE_CHECKING:
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.web.files import ImageStore

HISTORY_SIZE = 24
FORM_FIELDS = ("prompt", "resolution", "steps", "seed", "randomize", "guidance")  # kept in the browser


class SessionEvents:
    """Restore on page load, save on every change, collect what finished meanwhile; the form's fields are checked
    with the request's own checks (contract.requests), the browser's copy being untrusted."""

    def __init__(self, engine: EngineLike, store: ImageStore, held: sessions.HeldResults, uploads: Path):
        self.engine, self.store, self.held = engine, store, held
        self.uploads = uploads  # the only files a browser's session may name

    def on_restore(self, session: BrowserSession | None):
        """On page load: the form and history the browser kept, with the results that finished while it was away;
        the newest image shows. Outputs: session, prompt, resolution, steps, seed, randomize, guidance, history,
        history gallery, image, info, and the collect timer: active while a request from before the load runs."""
        saved: BrowserSession = session if isinstance(session, dict) else {}
        sid = sessions.session_id(saved) or sessions.new_session_id()
        kept = clean_history(saved.get("history"), self.store.folder, self.uploads, HISTORY_SIZE)
        held = self.held.results(sid)
        history = merge_history(kept, held, HISTORY_SIZE)
        arrived = [e for e in history if e not in kept]
        form = self._restore_form(saved)
        if arrived:
            form["seed"] = arrived[0].seed  # the seed box shows the seed of the image shown
        image = info = gr.skip()
        if history:
            image, info = history[0].path, history[0].info
        running = self.held.running(sid)
        if running:
            info = (f"*Your image at {running} is still being made (asked for before this page loaded); "
                    "it shows here when it is done.*")
        new_session = {**{k: saved.get(k) for k in FORM_FIELDS}, "id": sid, "history": to_json(history)}
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

    @staticmethod
    def on_save(session: BrowserSession | None, prompt: str, resolution: str, steps: float, seed: float | None,
                randomize: bool, guidance: float, history: list[HistoryEntry]) -> object:
        """The form and history into the browser's storage, under the session's id (given by on_restore: a change
        before it is not saved, or it would save under another id)."""
        sid = sessions.session_id(session)
        if sid is None:
            return gr.skip()
        values = dict(zip(FORM_FIELDS, (prompt, resolution, steps, seed, randomize, guidance)))
        return {**values, "id": sid, "history": to_json(history)}

    def on_collect(self, session: BrowserSession | None, history: list[HistoryEntry]):
        """The collect timer's tick, active only while the page awaits a request from before its load (it reloaded
        while the image was being made; an event that outputs to the image, even skipped, takes its progress display
        away from a request that runs): once done, the results the page has not shown are shown and the timer stops.
        Outputs: image, info, seed, history, gallery, the timer."""
        sid = sessions.session_id(session)
        known = {e.path for e in history}
        arrived = [e for e in self.held.results(sid) if e.path not in known and Path(e.path).is_file()]
        if not arrived:
            still = self.held.running(sid) is not None  # else it failed, or nothing was asked: stop waiting
            return (*(gr.skip(),) * 5, gr.skip() if still else gr.Timer(active=False))
        history = merge_history(history, arrived, HISTORY_SIZE)
        newest = arrived[0]
        return (newest.path, newest.info, newest.seed, history, gallery_items(history),
                gr.Timer(active=False))
