"""The form's handlers: they translate between Gradio values and studio calls and their answers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import gradio as gr

from neuron_ui.contract.files import StoredFiles
from neuron_ui.contract.requests import MAX_SEED, GenerateRequest
from neuron_ui.contract.results import Mode
from neuron_ui.contract.stopping import SessionStops
from neuron_ui.studio.grid_plan import DEFAULT_MAX_CELLS
from neuron_ui.studio.studio import DEFAULT_MAX_GRIDS, PreviewSink, Studio
from neuron_ui.ui.editing import file_path, file_paths, painted_mask
from neuron_ui.ui.history import EditorValue, HistoryEntry, entry_named, gallery_items, picked
from neuron_ui.ui.named_api import NamedApi
from neuron_ui.ui.session import HISTORY_SIZE, BrowserSession, HeldResults, SessionEvents, asker, session_id
from neuron_ui.web.errors import user_errors
from neuron_ui.web.files import PreviewFiles
from neuron_ui.web.progress import ProgressBar, ProgressReporter
from neuron_ui.ui.styles import describe_style, request_style
from neuron_ui.ui.words import (
    describe_activity,
    describe_inputs,
    describe_now,
    describe_prompt,
    describe_result,
    describe_size,
    describe_size_of,
    describe_stop,
    resolution_choices,
    status_rows,
)

if TYPE_CHECKING:
    from PIL import Image

    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.web.files import ImageStore
    from neuron_ui.ui.words import CompileWait


FAILED_WAIT = 120.0  # seconds the error line waits for a stopped request's reason
MAX_VARIATIONS = 4


class Handlers:
    """The form's events: UI values in, one studio call, UI values out. The browser session's save and restore
    (`session`, ui/session.py) and the named API (`api`, ui/named_api.py) are objects of their own over the
    same studio, built here with what they share."""

    def __init__(self, engine: EngineLike, store: ImageStore, waiting: Callable[[], int] | None = None,
                 held: HeldResults | None = None, uploads: Path | None = None,
                 stops: SessionStops | None = None, max_grid_cells: int = DEFAULT_MAX_CELLS,
                 max_grids: int = DEFAULT_MAX_GRIDS):
        # the running requests of each Gradio session, for Stop, /stop and disconnects (the server's gate too), are
        # the studio's; so are the grid jobs the Compare panel starts
        self.studio = Studio(engine, store, stops, max_grid_cells, max_grids)
        self.engine, self.store, self.stops = engine, store, self.studio.stops
        self.distilled = engine.status().distilled
        self.held = HeldResults() if held is None else held  # results a reloaded page comes back for
        self.uploads = uploads or store.folder  # Gradio's folder: the only files a browser's session may name
        self.stored = StoredFiles(self.uploads)  # the rule for every file a request names (contract/files.py)
        self.compile_wait: CompileWait | None = None  # the compile a request here waits for (one device)
        self.previews = PreviewFiles()  # the steps' estimates the page and the API are shown, the newest kept
        self.session = SessionEvents(engine, store, self.held, self.uploads)
        self.api = NamedApi(self.studio, self.stored, self.previews, waiting or (lambda: 0))

    def _request(self, prompt: str, resolution: str, steps: float | None, seed: float | None,
                 guidance: float | None, references: object = None, reference_size: str | None = None,
                 fit: str = "crop", style: str | None = None, style_strength: float | None = None,
                 image: str | None = None, mask: Image.Image | None = None,
                 strength: float | None = None) -> GenerateRequest:
        """The form's values as a request (an inpaint's with `image`); a file that is not the app's: one line."""
        lora, lora_scale = request_style(style, style_strength)
        with user_errors():
            # Distilled models ignore guidance; the engine's default is the model's own.
            return GenerateRequest(prompt, resolution, steps, seed, None if self.distilled else guidance,
                                   references=file_paths(references, self.stored),
                                   reference_size=reference_size or None, fit=fit, image=image, mask=mask,
                                   strength=strength, lora=lora, lora_scale=lora_scale)

    def run(self, request: GenerateRequest, history: list[HistoryEntry], progress: ProgressBar,
            session: BrowserSession | None = None, editor: EditorValue | None = None,
            on_preview: PreviewSink | None = None, prefix: str = ""):
        """One request (generate, or inpaint for a request with an image) through the studio, which saves the PNG,
        into the Generate button's outputs: image, line, seed, history, gallery. Its history entry is held for the
        session's page too (it may have reloaded by the time the image is done). `editor`: an inpaint's editor value,
        kept in the entry; `on_preview`: hears each step's estimate of the image; the line's words on a style switch
        compare with the history's newest (the visitor's previous image)."""
        sid = session_id(session)
        what = request.resolution if isinstance(request.resolution, str) else ""
        make = self.studio.inpaint if request.image is not None else self.studio.generate
        self.held.begin(sid)  # its failure's line waits for its reason (on_failed)
        try:
            with user_errors(), ProgressReporter(progress, prefix, self.on_compile) as reporter:
                # held only once the engine has checked the request: bad ones take no room
                made = make(request, asker(session, progress=reporter, on_admitted=lambda: self.held.start(sid, what),
                                           on_preview=on_preview))
        except gr.Error as error:
            self.held.fail(sid, error.message)
            raise
        finally:
            self.held.end(sid)
        result = made.result
        entry = HistoryEntry.made_from(
            result, str(made.path),
            describe_result(result, show_guidance=not self.distilled) + describe_inputs(result)
            + describe_style(result, next(iter(history), None)),
            tuple(r for r in request.references if isinstance(r, str)), request.reference_size, request.fit, editor)
        self.held.hold(sid, entry)
        # newest first, capped, and without entries whose file the store has since dropped
        history = [e for e in [entry, *history] if Path(e.path).is_file()][:HISTORY_SIZE]
        return entry.path, entry.info, entry.seed, history, gallery_items(history)

    def on_compile(self, wait: CompileWait | None) -> None:
        """The compile a request here waits for (None once it is done), for the line of what the device does now."""
        self.compile_wait = wait

    def on_generate(self, prompt: str, resolution: str, steps: float, seed: float | None, randomize: bool,
                    guidance: float, history: list[HistoryEntry], references: object = None,
                    reference_size: str | None = None, fit: str = "crop", session: BrowserSession | None = None,
                    style: str | None = None, style_strength: float | None = None,
                    progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:
        """The Generate button: one image from the form, the image slot showing each step's estimate of the image (at
        the latents' resolution; the page draws it larger) until the image itself; the seed box then shows the seed
        actually used."""
        request = self._request(prompt, resolution, steps, None if randomize else seed, guidance, references,
                                reference_size, fit, style, style_strength)
        yield from self.previews.shown(lambda sink: self.run(request, history, progress, session, on_preview=sink),
                                       lambda path, _: (path, *[gr.skip()] * 4))

    def on_inpaint(self, editor: object, prompt: str, resolution: str, strength: float, steps: float,
                   seed: float | None, randomize: bool, guidance: float, files: object, reference_size: str,
                   fit: str, history: list[HistoryEntry], session: BrowserSession | None = None,
                   style: str | None = None, style_strength: float | None = None,
                   progress: gr.Progress = gr.Progress()):
        """Inpaint's click, with the editor's value its page-only first step handed on (editing.add_inpaint_tab)."""
        # The editor's value as sent (preprocess=False): its background and painted layers are files the browser
        # uploaded, each with the upload checks and one line, like /inpaint's.
        value = editor if isinstance(editor, dict) else {}
        with user_errors():
            image = file_path(value.get("background"), self.stored)
            layers = file_paths(value.get("layers"), self.stored)
            mask = painted_mask(image, layers) if image else None
        if image is None:
            raise gr.Error("Upload an image (or click Edit this image on a result), then paint the part to redo.",
                           print_exception=False)
        request = self._request(prompt, resolution, steps, None if randomize else seed, guidance, files,
                                reference_size, fit, style, style_strength, image, mask, strength)
        # The editor's image and painted layers join the history entry, so picking it restores the mask too.
        return self.run(request, history, progress, session, EditorValue(image, tuple(layers)))

    def on_variations(self, prompt: str, resolution: str, steps: float, seed: float | None, randomize: bool,
                      guidance: float, count: float, history: list[HistoryEntry], session: BrowserSession | None = None,
                      style: str | None = None, style_strength: float | None = None,
                      progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:
        """N images at consecutive seeds, one after another at batch 1 (no new shape), each shown when done; the
        seed box shows the seed of the image shown."""
        count = int(count)
        if not 1 <= count <= MAX_VARIATIONS:
            raise gr.Error(f"variations must be 1 to {MAX_VARIATIONS}, got {count}", print_exception=False)
        first: int | None = None  # the seed the first image used: the others follow it
        gallery = []
        for index in range(count):
            next_seed = (None if randomize else seed) if first is None else (first + index) % (MAX_SEED + 1)
            request = self._request(prompt, resolution, steps, next_seed, guidance, style=style,
                                    style_strength=style_strength)
            image, info, used, history, items = self.run(request, history, progress, session,
                                                         prefix=f"image {index + 1}/{count}: ")
            first = used if first is None else first
            gallery.append((image, f"seed {used}"))
            yield image, info, used, list(gallery), history, items

    def on_warmup(self, resolution: str, session: BrowserSession | None = None,
                  progress: gr.Progress = gr.Progress()) -> str:
        """Compile the chosen size now, so the first image at it is fast."""
        with user_errors(), ProgressReporter(progress, on_compile=self.on_compile) as reporter:
            return describe_size(self.studio.warmup(resolution, asker(session, progress=reporter)))

    @staticmethod
    def on_select(history: list[HistoryEntry], event: gr.SelectData):
        """Restore a history entry's parameters (and show its image) so it can be made again or varied: prompt,
        size, steps, seed, then the edit's references, reference size, fit, and for an inpaint its image and mask
        (the editor's value), strength, and that the editor holds an image (for the layout hint; else left)."""
        entry = picked(history, event)
        if entry is None:
            raise gr.Error("that image is no longer in this session's history", print_exception=False)
        editor = entry.editor if entry.mode == Mode.INPAINT else None
        return (entry.prompt, entry.resolution, gr.skip() if entry.steps is None else entry.steps, entry.seed, False,
                entry.path, entry.info, list(entry.references) or None, entry.reference_size or gr.skip(), entry.fit,
                editor.to_gradio() if editor else gr.skip(),
                gr.skip() if editor is None or entry.strength is None else entry.strength,
                True if editor else gr.skip())

    @staticmethod
    def on_seed_typed(seed: float | None) -> bool:
        """A typed seed is the seed used: typing one unticks Randomize (emptying the box ticks it)."""
        return seed is None

    async def on_failed(self, session: BrowserSession | None) -> str:
        """The line under the image after an error: it says the error, never the previous image's parameters. A Stop
        fails the event before its request ends (at its next step, or once a load or compile is done): the line
        waits for the reason (HeldResults.settled) without holding a thread."""
        await self.on_settled(session)
        error = self.held.error(session_id(session))
        why = f" {error}{'' if error.endswith(('.', '!', '?')) else '.'}" if error else " The message says why."
        return f"**Not made:**{why} (The image above, if any, is the one before.)"

    async def on_settled(self, session: BrowserSession | None) -> None:
        """Returns once the session's requests here have ended (or FAILED_WAIT has passed), without holding a thread:
        a cancelled event ends in the page before its request does, and what follows it must see the request's end."""
        sid = session_id(session)
        deadline = time.monotonic() + FAILED_WAIT
        while not self.held.settled(sid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def on_prompt(self, text: str | None) -> str:
        """The prompt's tokens against what the text encoder reads, and its characters against the box's cap."""
        return describe_prompt(text, self.engine.prompt_tokens) if text and text.strip() else ""

    def on_reuse_seed(self, history: list[HistoryEntry], image: object = None):
        """Put the seed of the image shown back in the box (the newest's when none of the history is shown) and stop
        randomizing: after a history click it reused the newest variation's seed, not the one shown."""
        if not history:
            gr.Warning("No image yet in this session: there is no last seed to reuse.")
            return gr.skip(), gr.skip()
        shown = entry_named(history, image) or history[0]
        return shown.seed, False

    def on_stop(self, request: gr.Request) -> None:
        """Stop this browser's image at the next step, or take it out of the queue; a notice says which. The line
        under the image is the failure event's alone (on_failed: the stopped request's reason): two writers to it
        raced, and the stop's line overwrote the reason in 8 of 20 stops here (tests/test_browser_studio.py)."""
        gr.Info(describe_stop(self.stops.stop(request.session_hash)).replace("**", ""))

    def on_resolution(self, resolution: str) -> str:
        return describe_size_of(self.engine.status(), resolution)

    def on_tick(self, resolution: str, last: dict[str, object] | None):
        """Status table, activity line, dropdown labels, hint and the line of what the device does now, for every
        open browser; skipped when unchanged (a compile's elapsed seconds change it every tick)."""
        status = self.api.status()  # its queue depth counts the requests still in Gradio's queue too
        now = describe_now(status, self.compile_wait)
        signature = {**status.to_dict(), "now": now}
        if signature == last:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), last
        return (status_rows(status), describe_activity(status), gr.Dropdown(choices=resolution_choices(status)),
                describe_size_of(status, resolution), now, signature)

