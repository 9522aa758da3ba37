"""The UI's handlers: they translate between Gradio values and engine requests and results."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gradio as gr

from neuron_ui.contract.files import StoredFiles
from neuron_ui.contract.requests import MAX_GUIDANCE, MAX_PROMPT_CHARS, MAX_SEED, MAX_STEPS, GenerateRequest
from neuron_ui.contract.stopping import SessionStops
from neuron_ui.ui import session as sessions
from neuron_ui.ui.editing import file_paths
from neuron_ui.web.errors import public_status, user_errors
from neuron_ui.web.gradio_bridge import current_event
from neuron_ui.web.progress import ProgressReporter
from neuron_ui.ui.styles import describe_style, request_style
from neuron_ui.ui.visitors import current_visitor
from neuron_ui.ui.words import (
    describe_activity,
    describe_inputs,
    describe_now,
    describe_prompt,
    describe_result,
    describe_size,
    describe_size_of,
    describe_stop,
    first_ignored_word,
    resolution_choices,
    status_rows,
)

if TYPE_CHECKING:
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.contract.results import EngineStatus
    from neuron_ui.web.files import ImageStore
    from neuron_ui.ui.words import CompileWait


FAILED_WAIT = 120.0  # seconds the error line waits for a stopped request's reason
HISTORY_SIZE = 24
MAX_VARIATIONS = 4
FORM_FIELDS = ("prompt", "resolution", "steps", "seed", "randomize", "guidance")  # kept in the browser


def gallery_items(history: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(entry["path"], entry["resolution"]) for entry in history]


class Handlers:
    """The app's event handlers: UI values in, one engine call, UI values out."""

    def __init__(self, engine: EngineLike, store: ImageStore, waiting: Callable[[], int] | None = None,
                 held: sessions.HeldResults | None = None, uploads: Path | None = None,
                 stops: SessionStops | None = None):
        self.engine = engine
        self.store = store
        self.waiting = waiting or (lambda: 0)  # requests in Gradio's queue, not yet in the engine
        # the running requests of each Gradio session, for Stop, /stop and disconnects (the server's gate too)
        self.stops = SessionStops() if stops is None else stops
        self.distilled = engine.status().distilled
        self.held = sessions.HeldResults() if held is None else held  # results a reloaded page comes back for
        self.uploads = uploads or store.folder  # Gradio's folder: the only files a browser's session may name
        self.stored = StoredFiles(self.uploads)  # the rule for every file a request names (contract/files.py)
        self.compile_wait: CompileWait | None = None  # the compile a request here waits for (one device)

    def status(self) -> EngineStatus:
        """The engine's status, its queue depth counting the requests still in Gradio's queue too."""
        status = self.engine.status()
        return replace(status, queue_depth=status.queue_depth + self.waiting())

    def _request(self, prompt: str, resolution: str, steps: float | None, seed: float | None,
                 guidance: float | None, references: Any = None, reference_size: str | None = None,
                 fit: str = "crop", style: str | None = None, style_strength: float | None = None) -> GenerateRequest:
        # Distilled models ignore guidance; the engine's default is the model's own.
        lora, lora_scale = request_style(style, style_strength)
        return GenerateRequest(prompt, resolution, steps, seed, None if self.distilled else guidance,
                               references=file_paths(references, self.stored),
                               reference_size=reference_size or None, fit=fit, lora=lora, lora_scale=lora_scale)

    def _make(self, request: GenerateRequest, progress: Callable[..., Any], prefix: str = "",
              session: Any = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Generate, save the PNG, and return the history entry for it, held for the session's page too (it may
        have reloaded by the time the image is done). `extra` joins the entry (the inpaint editor's value)."""
        sid = sessions.session_id(session)
        request = replace(request, visitor=current_visitor(session))  # visitors take turns on the device
        what = request.resolution if isinstance(request.resolution, str) else ""

        def admitted() -> None:  # held only once the engine has checked the request: bad ones take no room
            self.held.start(sid, what)

        self.held.begin(sid)  # its failure's line waits for its reason (on_failed)
        try:
            with (user_errors(), ProgressReporter(progress, prefix, self._on_compile) as reporter,
                  self.stops.track(*current_event(), on_admitted=admitted) as stop):
                result = self.engine.generate(request, progress=reporter, stop=stop)
                path = self.store.save(result)  # a full disk is told like any other server failure
        except gr.Error as error:
            self.held.fail(sid, error.message)
            raise
        finally:
            self.held.end(sid)
        entry = {
            "path": path,
            "info": describe_result(result, show_guidance=not self.distilled) + describe_inputs(result)
            + describe_style(result),
            "cache_event": result.cache_event,
            "made": time.time(),
            **{key: getattr(result, key) for key in ("prompt", "resolution", "steps", "seed", "guidance", "mode",
                                                     "strength", "lora", "lora_scale")},
            "references": [r for r in request.references if isinstance(r, str)],
            "reference_size": request.reference_size,
            "fit": request.fit,
            **(extra or {}),
        }
        self.held.hold(sid, entry)
        return entry

    def _on_compile(self, wait: CompileWait | None) -> None:
        self.compile_wait = wait

    @staticmethod
    def _remember(entry: dict[str, Any], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Newest first, capped, and without entries whose file the store has since dropped."""
        return [e for e in [entry, *history] if Path(e["path"]).is_file()][:HISTORY_SIZE]

    def on_generate(self, prompt: str, resolution: str, steps: float, seed: float | None, randomize: bool,
                    guidance: float, history: list[dict[str, Any]], references: Any = None,
                    reference_size: str | None = None, fit: str = "crop", session: Any = None,
                    style: str | None = None, style_strength: float | None = None,
                    progress: gr.Progress = gr.Progress()):
        """One image from the form; the seed box then shows the seed actually used."""
        with user_errors():  # a reference that is not one of the app's files: one line
            request = self._request(prompt, resolution, steps, None if randomize else seed, guidance, references,
                                    reference_size, fit, style, style_strength)
        return self.run(request, history, progress, session)

    def run(self, request: GenerateRequest, history: list[dict[str, Any]], progress: Callable[..., Any],
            session: Any = None, extra: dict[str, Any] | None = None):
        """One request (generate or inpaint) into the Generate button's outputs."""
        entry = self._make(request, progress, session=session, extra=extra)
        history = self._remember(entry, history)
        return entry["path"], entry["info"], entry["seed"], history, gallery_items(history)

    def on_variations(self, prompt: str, resolution: str, steps: float, seed: float | None, randomize: bool,
                      guidance: float, count: float, history: list[dict[str, Any]], session: Any = None,
                      style: str | None = None, style_strength: float | None = None,
                      progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:
        """N images at consecutive seeds, one after another at batch 1 (no new shape), each shown when done; the
        seed box shows the seed of the image shown."""
        count = int(count)
        if not 1 <= count <= MAX_VARIATIONS:
            raise gr.Error(f"variations must be 1 to {MAX_VARIATIONS}, got {count}", print_exception=False)
        first, gallery = None, []
        for index in range(count):
            if index == 0:
                next_seed = None if randomize else seed
            else:
                next_seed = (first + index) % (MAX_SEED + 1)
            request = self._request(prompt, resolution, steps, next_seed, guidance, style=style,
                                    style_strength=style_strength)
            entry = self._make(request, progress, prefix=f"image {index + 1}/{count}: ", session=session)
            first = entry["seed"] if index == 0 else first
            gallery.append((entry["path"], f"seed {entry['seed']}"))
            history = self._remember(entry, history)
            yield entry["path"], entry["info"], entry["seed"], list(gallery), history, gallery_items(history)

    def on_warmup(self, resolution: str, session: Any = None, progress: gr.Progress = gr.Progress()) -> str:
        """Compile the chosen size now, so the first image at it is fast."""
        with user_errors(), ProgressReporter(progress, on_compile=self._on_compile) as reporter:
            return describe_size(self.engine.warmup(resolution, progress=reporter, visitor=current_visitor(session)))

    def on_select(self, history: list[dict[str, Any]], event: gr.SelectData):
        """Restore a history entry's parameters (and show its image) so it can be made again or varied: prompt,
        size, steps, seed, then the edit's references, reference size, fit, and for an inpaint its image and mask
        (the editor's value) and strength."""
        if not isinstance(event.index, int) or not 0 <= event.index < len(history):
            raise gr.Error("that image is no longer in this session's history", print_exception=False)
        entry = history[event.index]
        inpaint = entry.get("mode") == "inpaint" and entry.get("editor")
        return (entry["prompt"], entry["resolution"], entry["steps"], entry["seed"], False, entry["path"],
                entry["info"], entry.get("references") or None, entry.get("reference_size") or gr.skip(),
                entry.get("fit") or "crop", entry["editor"] if inpaint else gr.skip(),
                entry["strength"] if inpaint else gr.skip())

    @staticmethod
    def on_seed_typed(seed: float | None) -> bool:
        """A typed seed is the seed used: typing one unticks Randomize (emptying the box ticks it)."""
        return seed is None

    async def on_failed(self, session: Any) -> str:
        """The line under the image after an error: it says the error, never the previous image's parameters. A Stop
        fails the event before its request ends (at its next step, or once a load or compile is done): the line
        waits for the reason (HeldResults.settled) without holding a thread."""
        sid = sessions.session_id(session)
        await self._settled(sid)
        error = self.held.error(sid)
        why = f" {error}{'' if error.endswith(('.', '!', '?')) else '.'}" if error else " The message says why."
        return f"**Not made:**{why} (The image above, if any, is the one before.)"

    async def on_settled(self, session: Any) -> None:
        """Returns once the session's requests here have ended: a cancelled event ends in the page before its request
        does, and what follows it must see the request's end."""
        await self._settled(sessions.session_id(session))

    async def _settled(self, sid: str) -> None:
        """Waits, without holding a thread, until the session's requests have ended or FAILED_WAIT has passed."""
        deadline = time.monotonic() + FAILED_WAIT
        while not self.held.settled(sid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def on_prompt(self, text: str | None) -> str:
        """The prompt's tokens against what the text encoder reads, and its characters against the box's cap."""
        text = text or ""
        if not text.strip():
            return ""
        tokens, limit = self.engine.prompt_tokens(text)
        return describe_prompt(text, tokens, limit, first_ignored_word(text, limit, self.engine.prompt_tokens) if tokens > limit else None)

    # -- the session: what a reload or a new tab finds -----------------------------------------------

    def on_restore(self, session: Any):
        """On page load: the form and history the browser kept, with the results that finished while it was away;
        the newest image shows. Outputs: session, prompt, resolution, steps, seed, randomize, guidance, history,
        history gallery, image, info, and the collect timer: active while a request from before the load runs."""
        saved = session if isinstance(session, dict) else {}
        sid = sessions.session_id(saved) or sessions.new_session_id()
        kept = sessions.clean_history(saved.get("history"), self.store.folder, self.uploads, HISTORY_SIZE)
        held = self.held.results(sid)
        history = sessions.merge_history(kept, held, HISTORY_SIZE)
        arrived = [e for e in history if e not in kept]
        form = self._restore_form(saved)
        if arrived:
            form["seed"] = arrived[0]["seed"]  # the seed box shows the seed of the image shown
        image = info = gr.skip()
        if history:
            image, info = history[0]["path"], history[0]["info"]
        running = self.held.running(sid)
        if running:
            info = (f"*Your image at {running} is still being made (asked for before this page loaded); "
                    "it shows here when it is done.*")
        new_session = {**{k: saved.get(k) for k in FORM_FIELDS}, "id": sid, "history": history}
        return (new_session, *(form.get(k, gr.skip()) for k in FORM_FIELDS), history, gallery_items(history), image,
                info, gr.Timer(active=bool(running)))

    def _restore_form(self, saved: dict[str, Any]) -> dict[str, Any]:
        """The form fields the browser kept, each only if well-formed (the browser's copy is untrusted)."""
        def number(value: Any, low: float, high: float) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high

        presets = [str(p) for p in self.engine.presets]
        checks = {
            "prompt": lambda v: isinstance(v, str) and len(v) <= MAX_PROMPT_CHARS,
            "resolution": lambda v: v in presets,
            "steps": lambda v: number(v, 1, MAX_STEPS),
            "seed": lambda v: v is None or (number(v, 0, MAX_SEED) and float(v).is_integer()),
            "randomize": lambda v: isinstance(v, bool),
            "guidance": lambda v: number(v, 0, MAX_GUIDANCE),
        }
        return {k: saved[k] for k, check in checks.items() if k in saved and check(saved[k])}

    @staticmethod
    def on_save(session: Any, prompt: str, resolution: str, steps: float, seed: float | None, randomize: bool,
                guidance: float, history: list[dict[str, Any]]) -> Any:
        """The form and history into the browser's storage, under the session's id (given by on_restore: a change
        before it is not saved, or it would save under another id)."""
        sid = sessions.session_id(session)
        if sid is None:
            return gr.skip()
        values = dict(zip(FORM_FIELDS, (prompt, resolution, steps, seed, randomize, guidance)))
        return {**values, "id": sid, "history": history}

    def on_collect(self, session: Any, history: list[dict[str, Any]]):
        """The collect timer's tick, active only while the page awaits a request from before its load (it reloaded
        while the image was being made; an event that outputs to the image, even skipped, takes its progress display
        away from a request that runs): once done, the results the page has not shown are shown and the timer stops.
        Outputs: image, info, seed, history, gallery, the timer."""
        sid = sessions.session_id(session)
        known = {e["path"] for e in history}
        arrived = [e for e in self.held.results(sid) if e["path"] not in known and Path(e["path"]).is_file()]
        if not arrived:
            still = self.held.running(sid) is not None  # else it failed, or nothing was asked: stop waiting
            return (*(gr.skip(),) * 5, gr.skip() if still else gr.Timer(active=False))
        history = sessions.merge_history(history, arrived, HISTORY_SIZE)
        newest = arrived[0]
        return (newest["path"], newest["info"], newest["seed"], history, gallery_items(history),
                gr.Timer(active=False))

    def on_reuse_seed(self, history: list[dict[str, Any]]):
        """Put the last seed back in the box and stop randomizing."""
        if not history:
            gr.Warning("No image yet in this session: there is no last seed to reuse.")
            return gr.skip(), gr.skip()
        return history[0]["seed"], False

    def on_stop(self, request: gr.Request) -> None:
        """Stop this browser's image at the next step, or take it out of the queue; a notice says which. The line
        under the image is the failure event's alone (on_failed: the stopped request's reason): two writers to it
        raced, and the stop's line overwrote the reason in 8 of 20 stops here (tests/test_browser_studio.py)."""
        gr.Info(describe_stop(self.stops.stop(request.session_hash)).replace("**", ""))

    def on_resolution(self, resolution: str) -> str:
        return describe_size_of(self.engine.status(), resolution)

    def on_tick(self, resolution: str, last: Any):
        """Status table, activity line, dropdown labels, hint and the line of what the device does now, for every
        open browser; skipped when unchanged (a compile's elapsed seconds change it every tick)."""
        status = self.status()
        now = describe_now(status, self.compile_wait)
        signature = {**status.to_dict(), "now": now}
        if signature == last:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), last
        return (status_rows(status), describe_activity(status), gr.Dropdown(choices=resolution_choices(status)),
                describe_size_of(status, resolution), now, signature)

    # -- the named API (gradio_client) ------------------------------------------------------------

    def api_generate(self, prompt: str, resolution: str, steps: float | None = None, seed: float | None = None,
                     guidance: float | None = None, references: Any = None,
                     reference_size: str | None = None, lora: str | None = None,
                     lora_scale: float | None = None) -> tuple[str, dict[str, Any]]:
        """One image and its generation info; steps and guidance default to the model's, seed to random; `lora` a
        loaded style's name (None: none), `lora_scale` its strength (None: the style's default)."""
        with user_errors():
            request = GenerateRequest(prompt, resolution, steps, seed, guidance,
                                      references=file_paths(references, self.stored),
                                      reference_size=reference_size or None,
                                      lora=lora, lora_scale=lora_scale, visitor=current_visitor())
            with self.stops.track(*current_event()) as stop:
                result = self.engine.generate(request, stop=stop)
            return self.store.save(result), result.info()

    def api_warmup(self, resolution: str) -> dict[str, Any]:
        """Compile one preset without making an image; returns its status."""
        with user_errors():
            return asdict(self.engine.warmup(resolution, visitor=current_visitor()))

    def api_stop(self, request: gr.Request) -> dict[str, Any]:
        """Stop this client's requests (its session): a running image at the next step, a queued one at once."""
        phases = self.stops.stop(request.session_hash)
        return {"stopped": phases, "message": describe_stop(phases).replace("**", "")}

    def api_status(self) -> dict[str, Any]:
        """The engine status: every preset's state, compile seconds, hits and last latency."""
        return public_status(self.status())
