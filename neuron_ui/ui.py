"""The Gradio app: `build_demo(engine, settings)` returns a gr.Blocks whose handlers only translate UI <-> engine.

No torch here: the engine does the work and validates every value; the UI formats what the engine says.
Every event that runs the pipeline shares one concurrency group of size 1, so users queue instead of colliding.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Protocol

import gradio as gr

from . import ui_editing as editing
from .resolutions import Resolution
from .schema import (
    COMPILING,
    FAILED,
    MAX_GUIDANCE,
    MAX_SEED,
    MAX_STEPS,
    READY,
    EngineError,
    EngineStatus,
    GenerateRequest,
    GenerateResult,
    ProgressFn,
    ProgressUpdate,
    ShapeStatus,
)
from .settings import Settings

logger = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEVICE = "device"  # the concurrency group of every event that runs the pipeline
HISTORY_SIZE = 24
MAX_VARIATIONS = 4
REFRESH_SECONDS = 2.0
REAL_MODEL = "black-forest-labs/FLUX.2-klein-4B"
TABLE_HEADERS = ["size", "aspect", "state", "compile s", "hits", "last latency s"]
EVENT_WORDS = {
    "compiled": "compiled in {compile:.1f} s",
    "disk_hit": "compiled from disk cache in {compile:.1f} s",
    "memory_hit": "cache hit, {total:.2f} s",
    "eager": "eager, {total:.1f} s",
}


class EngineLike(Protocol):
    """What the UI uses of neuron_ui.engine.Engine, which it cannot import (that module imports torch)."""

    presets: tuple[Resolution, ...]

    def generate(self, request: GenerateRequest, progress: ProgressFn | None = None) -> GenerateResult: ...
    def warmup(self, resolution: str, progress: ProgressFn | None = None) -> ShapeStatus: ...
    def status(self) -> EngineStatus: ...
    def drain(self, timeout: float) -> bool: ...


# -- words: what the engine says, as a person reads it ------------------------------------------------


def describe_cache_event(result: GenerateResult) -> str:
    """What happened to the compile cache, with the time that matters for that event."""
    words = EVENT_WORDS.get(result.cache_event, result.cache_event + ", {total:.2f} s")
    return words.format(compile=result.compile_seconds, total=result.total_seconds)


def describe_result(result: GenerateResult, show_guidance: bool = False) -> str:
    """The line under the image; a compile's cost is told apart from the run's."""
    if not show_guidance:
        guidance = ""
    else:
        guidance = " · no guidance" if result.guidance is None else f" · guidance {result.guidance:g}"
    total = f" · {result.total_seconds:.2f} s total" if result.cache_event in ("compiled", "disk_hit") else ""
    return (
        f"**seed** {result.seed} · **{result.resolution}** · {result.steps} steps{guidance} · "
        f"{describe_cache_event(result)}{total}"
    )


def describe_state(shape: ShapeStatus) -> str:
    """A preset's state in a few words, for the dropdown and the status table."""
    if shape.state == READY:
        return f"ready (graph of {shape.shares_graph_with})" if shape.shares_graph_with else "ready"
    if shape.state == COMPILING:
        return "compiling now"
    if shape.state == FAILED:
        return "failed"
    if shape.on_disk:
        words = ("cached on disk (load time not measured yet)" if shape.estimate_seconds is None
                 else f"cached on disk (loads in about {shape.estimate_seconds:.0f} s)")
    else:
        about = "time unknown" if shape.estimate_seconds is None else f"about {shape.estimate_seconds:.0f} s"
        words = f"compiles on first use ({about})"
    return f"{words}, warm-up queued" if shape.warmup_queued else words


def describe_size(shape: ShapeStatus) -> str:
    """Tells the user, before they click, what the first image at this size will cost."""
    size = f"**{shape.resolution}**"
    if shape.state == READY:
        if shape.compile_seconds:
            took = f"Compiling took {shape.compile_seconds:.1f} s; images"
        elif shape.load_seconds:
            took = f"Loading it from the disk cache took {shape.load_seconds:.1f} s; images"
        else:
            took = "Images"
        return f"**Ready.** {took} at {size} come at full speed."
    if shape.state == COMPILING:
        return f"**Compiling now.** A request at {size} waits for the compilation to finish."
    if shape.state == FAILED:
        return f"**Failed to compile** {size} ({shape.error}). Generate or warm up to try again, or pick another size."
    about = f"about {shape.estimate_seconds:.0f} s" if shape.estimate_seconds is not None else "a while"
    if shape.on_disk:
        about = "load time not measured yet" if shape.estimate_seconds is None else about
        return (f"**Cached on disk.** The first image at {size} loads its compiled graph from the disk cache "
                f"({about}); later ones are fast.")
    return (
        f"**Not compiled yet.** The first image at {size} compiles first ({about}); later ones are fast. "
        "*Warm up this size* compiles it without making an image."
    )


def resolution_choices(status: EngineStatus) -> list[tuple[str, str]]:
    """Dropdown options: the label tells aspect and state, the value stays "WxH"."""
    return [(f"{s.resolution} ({s.aspect}) — {describe_state(s)}", s.resolution) for s in status.shapes]


def status_rows(status: EngineStatus) -> list[list[str]]:
    def number(value: float | None, digits: int) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    return [
        [s.resolution, s.aspect, describe_state(s), number(s.compile_seconds, 1), str(s.hits),
         number(s.last_latency, 2)]
        for s in status.shapes
    ]


def describe_engine(status: EngineStatus, settings: Settings) -> str:
    eager = status.compile_mode == "eager"
    compile_text = ("none (eager)" if eager else "ahead-of-time (AOTInductor packages)" if status.compile_mode == "aot"
                    else f"{status.compile_mode}, {status.compile_backend}")
    parallel = f" x{status.tensor_parallel['degree']} tensor-parallel" if status.tensor_parallel else ""
    return (
        f"**Model** {status.model} · **Device** {status.device}{parallel} · **dtype** {status.dtype} · "
        f"**Compile** {compile_text} · one image at a time, up to {settings.max_queue} waiting"
    )


def describe_activity(status: EngineStatus) -> str:
    """The line under the status table: what the device is doing for everyone right now."""
    device = "busy" if status.busy else "idle"
    if status.queue_depth:
        device += f", {status.queue_depth} waiting"
    parts = [f"**Device** {device}"]
    if not status.persistent_cache:
        parts.append("**Cache** not persistent: compiled sizes will not survive a restart")
    if status.warmup_queue:
        parts.append(f"**Warm-up** {', '.join(status.warmup_queue)} (about {status.warmup_seconds_left:.0f} s left; "
                     "your requests go first)")
    parts.append(f"shared by everyone using this server, refreshed every {REFRESH_SECONDS:g} s")
    return " · ".join(parts)


def tiny_banner(status: EngineStatus) -> str:
    why = f" It is served because {status.fallback_reason}." if status.fallback_reason else ""
    return (
        f"⚠️ **Tiny random-weight model: images are noise by design.** It lets you try the app offline.{why}\n\n"
        f"For real images start the app with `--model {REAL_MODEL}` or `--model /path/to/a/local/folder`."
    )


def public_status(status: EngineStatus) -> dict[str, Any]:
    """The engine status for the API, without server file paths."""
    data = status.to_dict()
    data.pop("cache_dir", None)
    if data.get("cache_error"):
        data["cache_error"] = "the compile cache is not persistent here; see the server log"
    for shape in data["shapes"]:
        if shape.get("error"):
            shape["error"] = redact_paths(shape["error"])
    return data


# An absolute path: "/a/b", "C:\\a\\b"; not the tail of a relative one ("../../etc/passwd" is left whole).
_PATH = re.compile(r"(?<![\w.~-])(?:[A-Za-z]:)?[/\\](?:[\w.~-]+[/\\])+[\w.~-]*")


def redact_paths(text: str) -> str:
    """Server file paths out of a server-side message that users see (a compiler's error names its temp files)."""
    return _PATH.sub("<path>", text)


# -- plumbing: errors, progress, saved images -------------------------------------------------------


@contextmanager
def user_errors() -> Iterator[None]:
    """Engine messages become gr.Error; anything unexpected is logged and told without details.

    A ValueError is the engine refusing a request: it quotes the user's own values, which stay readable as sent.
    An EngineError is a server-side failure: server paths in it (a compiler's temp files) are redacted.
    """
    try:
        yield
    except gr.Error:
        raise
    except Exception as error:
        if isinstance(error, ValueError):
            raise gr.Error(str(error), print_exception=False) from None
        if isinstance(error, EngineError):
            raise gr.Error(redact_paths(str(error)), print_exception=False) from None
        logger.exception("unexpected error in a UI handler")
        message = "the server failed unexpectedly; the details are in the server log"
        raise gr.Error(message, print_exception=False) from None


def progress_reporter(progress: Callable[..., Any], prefix: str = "") -> ProgressFn:
    """Map the engine's ProgressUpdate onto gr.Progress: compiling (no fraction), steps, decoding."""

    def report(update: ProgressUpdate) -> None:
        # Gradio shows no text for a None fraction, so a stage of unknown length shows as 0%.
        progress(update.fraction or 0.0, desc=prefix + update.message)

    return report


class ImageStore:
    """The app's one folder of generated PNGs, the newest `keep` kept; names are made here, never from user input.

    The folder lies inside this process's private Gradio folder (private_file_folder), so Gradio serves the PNGs
    in place instead of copying each one into its cache (which nothing would ever clean): one folder, bounded,
    removed at exit. A random part in each name keeps users from guessing the address of someone else's image.
    """

    def __init__(self, folder: Path | None = None, keep: int = 512):
        if folder is None:
            folder = Path(tempfile.mkdtemp(prefix="images-", dir=private_file_folder()))
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._saved: collections.deque[Path] = collections.deque()
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()

    def save(self, result: GenerateResult) -> str:
        with self._lock:
            name = f"{next(self._numbers):05d}-{secrets.token_hex(4)}-{result.resolution}-seed{result.seed}.png"
            path = self.folder / name
            self._saved.append(path)
            dropped = [self._saved.popleft() for _ in range(len(self._saved) - self.keep)]
        result.save_png(path)
        for oldest in dropped:
            oldest.unlink(missing_ok=True)
        return str(path)


PRIVATE_FOLDER = re.compile(r"neuron-ui-(\d+)-\w+")


def private_file_folder(environ: Any = os.environ) -> Path:
    """This process's own folder for every file Gradio serves, made once (mode 0700) and removed at exit.

    Gradio's file route serves everything under GRADIO_TEMP_DIR (default <temp>/gradio: other apps' and other
    users' files too) and under GRADIO_EXAMPLES_CACHE; both are pointed here, inside the folder they named
    (or <temp>), so this app serves only its own files. Gradio reads them when it builds components and mounts,
    so this runs first (ImageStore() in build_demo). Folders of killed processes (`neuron-ui-<pid>-*` whose pid
    is gone) are swept.
    """
    current = Path(environ.get("GRADIO_TEMP_DIR") or tempfile.gettempdir())
    mine = PRIVATE_FOLDER.fullmatch(current.name)
    if mine and int(mine.group(1)) == os.getpid() and current.is_dir():
        return current
    base = current.resolve()
    base.mkdir(parents=True, exist_ok=True)
    sweep_dead_folders(base)
    folder = Path(tempfile.mkdtemp(prefix=f"neuron-ui-{os.getpid()}-", dir=base))
    atexit.register(shutil.rmtree, folder, True)
    environ["GRADIO_TEMP_DIR"] = str(folder)
    environ["GRADIO_EXAMPLES_CACHE"] = str(folder / "examples")
    return folder


def sweep_dead_folders(base: Path) -> None:
    """Remove the private folders of processes that died without cleaning up (killed, out of memory)."""
    for folder in base.glob("neuron-ui-*"):
        owner = PRIVATE_FOLDER.fullmatch(folder.name)
        if owner and folder.is_dir() and folder.stat().st_uid == os.getuid() and not pid_alive(int(owner.group(1))):
            logger.info("removing %s, left by a stopped process", folder)
            shutil.rmtree(folder, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def load_example_prompts(path: Path = ASSETS / "prompts.txt") -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def gallery_items(history: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(entry["path"], entry["resolution"]) for entry in history]


# -- handlers -----------------------------------------------------------------------------------------


class Handlers:
    """The app's event handlers: UI values in, one engine call, UI values out."""

    def __init__(self, engine: EngineLike, store: ImageStore, waiting: Callable[[], int] | None = None):
        self.engine = engine
        self.store = store
        self.waiting = waiting or (lambda: 0)  # requests in Gradio's queue, not yet in the engine
        self.distilled = engine.status().distilled

    def status(self) -> EngineStatus:
        """The engine's status, its queue depth counting the requests still in Gradio's queue too."""
        status = self.engine.status()
        return replace(status, queue_depth=status.queue_depth + self.waiting())

    def _request(self, prompt: str, resolution: str, steps: float | None, seed: float | None,
                 guidance: float | None, references: Any = None, reference_size: str | None = None,
                 fit: str = "crop") -> GenerateRequest:
        # Distilled models ignore guidance; the engine's default is the model's own.
        return GenerateRequest(prompt, resolution, steps, seed, None if self.distilled else guidance,
                               references=editing.file_paths(references), reference_size=reference_size or None,
                               fit=fit)

    def _make(self, request: GenerateRequest, progress: Callable[..., Any], prefix: str = "") -> dict[str, Any]:
        """Generate, save the PNG, and return the history entry for it."""
        with user_errors():
            result = self.engine.generate(request, progress=progress_reporter(progress, prefix))
            path = self.store.save(result)  # a full disk is told like any other server failure
        return {
            "path": path,
            "info": describe_result(result, show_guidance=not self.distilled) + editing.describe_inputs(result),
            "cache_event": result.cache_event,
            **{key: getattr(result, key) for key in ("prompt", "resolution", "steps", "seed", "guidance")},
        }

    @staticmethod
    def _remember(entry: dict[str, Any], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Newest first, capped, and without entries whose file the store has since dropped."""
        return [e for e in [entry, *history] if Path(e["path"]).is_file()][:HISTORY_SIZE]

    def on_generate(self, prompt: str, resolution: str, steps: float, seed: float | None, randomize: bool,
                    guidance: float, history: list[dict[str, Any]], references: Any = None,
                    reference_size: str | None = None, fit: str = "crop", progress: gr.Progress = gr.Progress()):
        """One image from the form; the seed box then shows the seed actually used."""
        request = self._request(prompt, resolution, steps, None if randomize else seed, guidance, references,
                                reference_size, fit)
        return self.run(request, history, progress)

    def run(self, request: GenerateRequest, history: list[dict[str, Any]], progress: Callable[..., Any]):
        """One request (generate or inpaint) into the Generate button's outputs."""
        entry = self._make(request, progress)
        history = self._remember(entry, history)
        return entry["path"], entry["info"], entry["seed"], history, gallery_items(history)

    def on_variations(self, prompt: str, resolution: str, steps: float, seed: float | None, randomize: bool,
                      guidance: float, count: float, history: list[dict[str, Any]],
                      progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:
        """N images at consecutive seeds, one after another at batch 1 (no new shape), each shown when done."""
        count = int(count)
        if not 1 <= count <= MAX_VARIATIONS:
            raise gr.Error(f"variations must be 1 to {MAX_VARIATIONS}, got {count}", print_exception=False)
        first, gallery = None, []
        for index in range(count):
            if index == 0:
                next_seed = None if randomize else seed
            else:
                next_seed = (first + index) % (MAX_SEED + 1)
            request = self._request(prompt, resolution, steps, next_seed, guidance)
            entry = self._make(request, progress, prefix=f"image {index + 1}/{count}: ")
            first = entry["seed"] if index == 0 else first
            gallery.append((entry["path"], f"seed {entry['seed']}"))
            history = self._remember(entry, history)
            yield entry["path"], entry["info"], first, list(gallery), history, gallery_items(history)

    def on_warmup(self, resolution: str, progress: gr.Progress = gr.Progress()) -> str:
        """Compile the chosen size now, so the first image at it is fast."""
        with user_errors():
            return describe_size(self.engine.warmup(resolution, progress=progress_reporter(progress)))

    def on_select(self, history: list[dict[str, Any]], event: gr.SelectData):
        """Restore a history entry's parameters (and show its image) so it can be made again or varied."""
        if not isinstance(event.index, int) or not 0 <= event.index < len(history):
            raise gr.Error("that image is no longer in this session's history", print_exception=False)
        entry = history[event.index]
        return (entry["prompt"], entry["resolution"], entry["steps"], entry["seed"], False, entry["path"],
                entry["info"])

    def on_reuse_seed(self, history: list[dict[str, Any]]):
        """Put the last seed back in the box and stop randomizing."""
        if not history:
            gr.Warning("No image yet in this session: there is no last seed to reuse.")
            return gr.skip(), gr.skip()
        return history[0]["seed"], False

    def on_resolution(self, resolution: str) -> str:
        return self._size_hint(self.engine.status(), resolution)

    def on_tick(self, resolution: str, last: Any):
        """Status table, activity line, dropdown labels and hint for every open browser; skipped when unchanged."""
        status = self.status()
        signature = status.to_dict()
        if signature == last:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), last
        return (status_rows(status), describe_activity(status), gr.Dropdown(choices=resolution_choices(status)),
                self._size_hint(status, resolution), signature)

    @staticmethod
    def _size_hint(status: EngineStatus, resolution: str) -> str:
        shape = next((s for s in status.shapes if s.resolution == resolution), None)
        return describe_size(shape) if shape else ""

    # -- the named API (gradio_client) ------------------------------------------------------------

    def api_generate(self, prompt: str, resolution: str, steps: float | None = None, seed: float | None = None,
                     guidance: float | None = None, references: Any = None,
                     reference_size: str | None = None) -> tuple[str, dict[str, Any]]:
        """One image and its generation info; steps and guidance default to the model's, seed to random."""
        with user_errors():
            request = GenerateRequest(prompt, resolution, steps, seed, guidance,
                                      references=editing.file_paths(references), reference_size=reference_size or None)
            result = self.engine.generate(request)
            return self.store.save(result), result.info()

    def api_warmup(self, resolution: str) -> dict[str, Any]:
        """Compile one preset without making an image; returns its status."""
        with user_errors():
            return asdict(self.engine.warmup(resolution))

    def api_status(self) -> dict[str, Any]:
        """The engine status: every preset's state, compile seconds, hits and last latency."""
        return public_status(self.status())


# -- layout and wiring ----------------------------------------------------------------------------------


def device_queue_length(demo: gr.Blocks) -> int:
    """Requests Gradio has accepted for the device and not yet started.

    Gradio 6 has no public call for this. Its queue keeps one EventQueue per concurrency id, whose `queue` list
    holds the events not yet started (gradio/queueing.py: Queue.event_queue_per_concurrency_id); only this
    function reads it, and tests/test_load.py fails if Gradio moves it (it compares with /gradio_api/queue/status).
    """
    try:
        event_queue = demo._queue.event_queue_per_concurrency_id.get(DEVICE)
        return 0 if event_queue is None else len(event_queue.queue)
    except AttributeError:
        if not _UNREADABLE_QUEUE:
            _UNREADABLE_QUEUE.append(True)
            logger.warning("cannot read Gradio's queue length (a Gradio change?); queue depth counts the engine only")
        return 0


_UNREADABLE_QUEUE: list[bool] = []  # warned once


def waiting_for_device(demo: gr.Blocks, engine: EngineLike) -> int:
    """Everything accepted and not yet on the device: Gradio's queue, then the engine's own (behind a warm-up)."""
    return device_queue_length(demo) + engine.status().queue_depth


def launch_options() -> dict[str, Any]:
    """Theme and CSS: Gradio 6 takes them at launch (or mount), not in Blocks()."""
    theme = gr.themes.Soft(primary_hue="amber", secondary_hue="slate", neutral_hue="slate")
    return {"theme": theme, "css_paths": [ASSETS / "style.css"]}


def build_demo(engine: EngineLike, settings: Settings) -> gr.Blocks:
    """The whole app around one engine; queue() and launch() are the caller's (app.py)."""
    status = engine.status()
    handlers = Handlers(engine, ImageStore())
    first = str(engine.presets[0])
    with gr.Blocks(title="neuron-ui · FLUX.2-klein", analytics_enabled=False) as demo:
        history, seen = gr.State([]), gr.State(None)
        gr.Markdown(f"# neuron-ui · FLUX.2-klein\n{describe_engine(status, settings)}", elem_id="header")
        if status.is_tiny:
            gr.Markdown(tiny_banner(status), elem_id="tiny-banner")
        if status.cache_error:
            gr.Markdown("Compiled sizes will not survive a restart: the compile cache is not persistent here.",
                        elem_id="cache-warning")
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=340):
                prompt = gr.Textbox(label="Prompt", placeholder="Describe the image, then press Enter",
                                    lines=1, max_lines=4, max_length=2000, elem_id="prompt", autofocus=True)
                resolution = gr.Dropdown(resolution_choices(status), value=first, label="Resolution",
                                         elem_id="resolution")
                hint = gr.Markdown(describe_size(status.shape(first)), elem_id="size-hint")
                with gr.Row():
                    generate = gr.Button("Generate", variant="primary", elem_id="generate")
                    warmup = gr.Button("Warm up this size", elem_id="warmup")
                with gr.Row(equal_height=False, elem_id="variations-row"):
                    count = gr.Radio(list(range(1, MAX_VARIATIONS + 1)), value=MAX_VARIATIONS, scale=2,
                                     label="Variations", info="same prompt, consecutive seeds", elem_id="count")
                    make_variations = gr.Button("Make variations", scale=1, elem_id="make-variations")
                with gr.Accordion("Advanced", open=False, elem_id="advanced"):
                    steps = gr.Slider(1, MAX_STEPS, value=status.default_steps, step=1, label="Steps",
                                      info=f"the model's default is {status.default_steps}", elem_id="steps")
                    with gr.Row(equal_height=True):
                        seed = gr.Number(label="Seed", precision=0, minimum=0, maximum=MAX_SEED, scale=2,
                                         elem_id="seed")
                        with gr.Column(scale=1, min_width=120):
                            randomize = gr.Checkbox(True, label="Randomize", elem_id="randomize")
                            reuse = gr.Button("Reuse last seed", size="sm", elem_id="reuse-seed")
                    guidance = gr.Slider(0, MAX_GUIDANCE, value=status.default_guidance, step=0.1,
                                         label="Guidance", visible=not status.distilled, elem_id="guidance")
                edit_refs = editing.add_reference_panel(engine)
                with gr.Accordion("Inpaint", open=False, elem_id="inpaint-panel") as inpaint_panel:
                    edit_inpaint = editing.add_inpaint_tab()
                examples = load_example_prompts()
                if examples:
                    gr.Examples([[text] for text in examples], inputs=[prompt], label="Example prompts")
            with gr.Column(scale=3, min_width=380):
                image = gr.Image(label="Image", type="filepath", format="png", interactive=False, height=440,
                                 buttons=["download", "fullscreen"], elem_id="image")
                info = gr.Markdown(elem_id="info")
                edit_result = editing.add_result_buttons()
                layout_hint = gr.Markdown(elem_id="layout-hint")
                variations = gr.Gallery(label="Variations", columns=MAX_VARIATIONS, fit_columns=False, height=230,
                                        visible=False, elem_id="variations")
                history_gallery = gr.Gallery(label="History: click an image to restore its settings", columns=6,
                                             fit_columns=False, height=240, allow_preview=False, elem_id="history")
        with gr.Accordion("Sizes on this server", open=True, elem_id="status"):
            table = gr.Dataframe(status_rows(status), headers=TABLE_HEADERS, interactive=False,
                                 elem_id="status-table")
            activity = gr.Markdown(describe_activity(status), elem_id="activity")
        timer = gr.Timer(REFRESH_SECONDS)

        # Every event that runs the pipeline: one at a time across all users, waiting in one bounded queue.
        on_device = {"concurrency_id": DEVICE, "concurrency_limit": 1}
        private = {"api_visibility": "private"}
        refresh = {"fn": handlers.on_tick, "inputs": [resolution, seen],
                   "outputs": [table, activity, resolution, hint, seen], "show_progress": "hidden", "queue": False,
                   **private}
        form = [prompt, resolution, steps, seed, randomize, guidance]
        ref_inputs = [edit_refs["files"], edit_refs["size"], edit_refs["fit"]]
        gr.on([generate.click, prompt.submit], handlers.on_generate, [*form, history, *ref_inputs],
              [image, info, seed, history, history_gallery], show_progress_on=[image], **on_device,
              **private).then(**refresh)
        make_variations.click(lambda: gr.Gallery(value=[], visible=True), None, variations, queue=False,
                              **private).then(
            handlers.on_variations, [*form, count, history], [image, info, seed, variations, history,
                                                                history_gallery],
            show_progress_on=[image, variations], **on_device, **private).then(**refresh)
        warmup.click(handlers.on_warmup, [resolution], [hint], **on_device, **private).then(**refresh)
        resolution.change(handlers.on_resolution, [resolution], [hint], show_progress="hidden", queue=False,
                          **private)
        history_gallery.select(handlers.on_select, [history],
                               [prompt, resolution, steps, seed, randomize, image, info], queue=False, **private)
        reuse.click(handlers.on_reuse_seed, [history], [seed, randomize], queue=False, **private)
        timer.tick(**refresh)
        demo.load(**refresh)
        editing_handlers = editing.EditingHandlers(engine, handlers.run, handlers.store.save, user_errors,
                                                   handlers.distilled)
        layout_inputs = [resolution, edit_refs["files"], edit_refs["size"]]
        hidden = {"show_progress": "hidden", "queue": False, **private}
        gr.on([edit_refs["files"].change, edit_refs["size"].change, edit_refs["fit"].change],
              editing_handlers.on_preview, ref_inputs, edit_refs["previews"], **hidden)
        gr.on([edit_refs["files"].change, edit_refs["size"].change, resolution.change, generate.click],
              editing_handlers.on_layout, layout_inputs, layout_hint, **hidden)
        edit_result["use"].click(editing_handlers.on_use_as_reference, [image, edit_refs["files"]],
                                 edit_refs["files"], **hidden)
        edit_result["edit"].click(editing_handlers.on_edit_image, [image], [edit_inpaint["editor"], inpaint_panel],
                                  **hidden)
        edit_inpaint["button"].click(
            editing_handlers.on_inpaint,
            [edit_inpaint["editor"], prompt, resolution, edit_inpaint["strength"], steps, seed, randomize, guidance,
             *ref_inputs, history],
            [image, info, seed, history, history_gallery], show_progress_on=[image], **on_device, **private,
        ).then(**refresh)

        # The named API for gradio_client: its own inputs, so the engine (not UI widgets) validates them.
        with gr.Column(visible=False):
            api_inputs = [gr.Textbox(label="prompt"), gr.Textbox(label="resolution"), gr.Number(label="steps"),
                          gr.Number(label="seed"), gr.Number(label="guidance"), *editing.api_reference_inputs()]
            api_outputs = [gr.Image(label="image", type="filepath", format="png"), gr.JSON(label="info")]
            api_trigger = gr.Button()
        # preprocess=False: the engine sees the values as sent (a number for the prompt is refused, not made text).
        api_trigger.click(handlers.api_generate, api_inputs, api_outputs, api_name="generate", preprocess=False,
                          **on_device)
        editing.add_inpaint_api(editing_handlers, on_device)
        gr.api(handlers.api_warmup, api_name="warmup", **on_device)
        gr.api(handlers.api_status, api_name="status", concurrency_limit=None)
    handlers.waiting = lambda: device_queue_length(demo)
    return demo
