"""The Gradio app: `build_demo(engine, settings)` returns a gr.Blocks whose handlers only translate UI <-> engine.

No torch here: the engine does the work and validates every value; the UI formats what the engine says.
Every event that runs the pipeline shares one concurrency group of size 1, so users queue instead of colliding.
"""

from __future__ import annotations

import atexit
import collections
import contextvars
import itertools
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import gradio as gr

from . import session as sessions
from . import ui_editing as editing
from .resolutions import Resolution
from .schema import (
    EngineLike,
    COMPILING,
    FAILED,
    MAX_GUIDANCE,
    MAX_PROMPT_CHARS,
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
from .stopping import COMPILING as STOP_COMPILING
from .stopping import DONE, QUEUED, RUNNING, SessionStops

logger = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEVICE = "device"  # the concurrency group of every event that runs the pipeline
HISTORY_SIZE = 24
MAX_VARIATIONS = 4
REFRESH_SECONDS = 2.0
FORM_FIELDS = ("prompt", "resolution", "steps", "seed", "randomize", "guidance")  # kept in the browser
REAL_MODEL = "black-forest-labs/FLUX.2-klein-4B"
TABLE_HEADERS = ["size", "aspect", "state", "graph ready in s", "images", "last image s"]
TABLE_LEGEND = (
    "**graph ready in s**: how long the size's compiled graph took to become ready in this server (compiled, or "
    "“load” from the disk cache); sizes that share one graph show that graph's time · **images**: images made at "
    "the size since the server started · **last image s**: how long the latest one took, any compile included"
)
GUESS = "a guess: nothing measured on this machine yet"
TICK_SECONDS = 1.0  # how often a compile's elapsed time is re-reported while it runs
EVENT_WORDS = {
    "compiled": "compiled in {compile:.1f} s",
    "disk_hit": "compiled from disk cache in {compile:.1f} s",
    "memory_hit": "cache hit, {total:.2f} s",
    "eager": "eager, {total:.1f} s",
}


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
    waited = f"waited {result.waited_seconds:.0f} s for {result.waited_for} · " if result.waited_for else ""
    return (
        f"**seed** {result.seed} · **{result.resolution}** · {result.steps} steps{guidance} · "
        f"{waited}{describe_cache_event(result)}{total}"
    )


def describe_estimate(shape: ShapeStatus, short: bool = False) -> str:
    """ "about 41 s", or a built-in guess said as one until this machine has measured a compile."""
    if shape.estimate_seconds is None:
        return "time unknown"
    about = f"about {shape.estimate_seconds:.0f} s"
    if shape.estimate_guess:
        about += ", a guess" if short else f", {GUESS}"
    return about


STOP_WORDS = {
    RUNNING: "**Stopped.** The image stops at the next step; the device is free for the next person.",
    QUEUED: "**Stopped.** Your request left the queue; no image was made.",
    STOP_COMPILING: "**Stopping.** The size keeps compiling and will be ready; your image is not made.",
    DONE: "Nothing to stop: the image was already made.",
}


def describe_stop(phases: list[str]) -> str:
    """What a Stop did, by where the session's requests were when it came (stopping.StopToken.stop)."""
    if not phases:
        return "Nothing to stop: no image of yours is being made or waiting."
    return " ".join(STOP_WORDS[phase] for phase in sorted(set(phases), key=list(STOP_WORDS).index))


def describe_state(shape: ShapeStatus) -> str:
    """A preset's state in a few words, for the dropdown and the status table."""
    if shape.state == READY and shape.replicas_total:
        return describe_ready_on(shape)
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
        words = f"compiles on first use ({describe_estimate(shape, short=True)})"
    return f"{words}, warm-up queued" if shape.warmup_queued else words


def describe_ready_on(shape: ShapeStatus) -> str:
    """With replicas: on how many the size's graph is loaded; the others load it from the cache when asked."""
    return f"ready on {shape.ready_on} of {shape.replicas_total}"


def describe_replicas(status: EngineStatus) -> str:
    """The replicas section: how many answer, and what each holds and does."""
    rows = status.replicas or []
    healthy = [r for r in rows if r["state"] == "healthy"]
    parts = [f"{r['replica'][:6]} {r['state'] if r['state'] != 'healthy' else 'busy' if r['busy'] else 'idle'}, "
             f"{len(r['graphs'])} graph{'s' if len(r['graphs']) != 1 else ''}, {r['devices']}" for r in rows]
    states = status.replica_states or {}
    restarting = sum(states.get(s, 0) for s in ("STARTING", "RECOVERING", "UPDATING"))
    starting = f", {restarting} restarting" if restarting else ""
    return f"**Replicas** {len(healthy)} healthy{starting} ({'; '.join(parts)})"


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
    about = describe_estimate(shape) if shape.estimate_seconds is not None else "a while"
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


def graph_seconds(shape: ShapeStatus, status: EngineStatus) -> str:
    """How long the size's graph took to be ready here; a size that shares a graph shows the sharer's time."""
    if shape.shares_graph_with:
        sharer = next((s for s in [*status.shapes, *status.layouts]
                       if (s.layout or s.resolution) == shape.shares_graph_with), None)
        shape = sharer or shape
    if shape.compile_seconds is not None and shape.state == READY:
        return f"{shape.compile_seconds:.1f}"
    if shape.load_seconds is not None and shape.state == READY:
        return f"{shape.load_seconds:.1f} load"
    return "—"


def status_rows(status: EngineStatus) -> list[list[str]]:
    """One row per preset; every column means one thing (TABLE_LEGEND says which)."""
    return [
        [s.resolution, s.aspect, describe_state(s), graph_seconds(s, status), str(s.images),
         "—" if s.last_latency is None else f"{s.last_latency:.2f}"]
        for s in status.shapes
    ]


def describe_engine(status: EngineStatus, settings: Settings) -> str:
    eager = status.compile_mode == "eager"
    compile_text = ("none (eager)" if eager else "ahead-of-time (AOTInductor packages)" if status.compile_mode == "aot"
                    else f"{status.compile_mode}, {status.compile_backend}")
    parallel = f" x{status.tensor_parallel['degree']} tensor-parallel" if status.tensor_parallel else ""
    per = f" on each of {settings.replicas} replicas" if settings.replicas else ""
    return (
        f"**Model** {status.model} · **Device** {status.device}{parallel} · **dtype** {status.dtype} · "
        f"**Compile** {compile_text} · one image at a time{per}, up to {settings.max_queue} waiting"
    )


def describe_activity(status: EngineStatus) -> str:
    """The line under the status table: what the device is doing for everyone right now."""
    device = "busy" if status.busy else "idle"
    if status.queue_depth:
        device += f", {status.queue_depth} waiting"
    parts = [f"**Device** {device}"]
    if status.replicas is not None:
        parts.append(describe_replicas(status))
    if not status.persistent_cache:
        parts.append("**Cache** not persistent: compiled sizes will not survive a restart")
    if status.warmup_queue:
        parts.append(f"**Warm-up** {', '.join(status.warmup_queue)} (about {status.warmup_seconds_left:.0f} s left; "
                     "your requests go first)")
    parts.append(f"shared by everyone using this server, refreshed every {REFRESH_SECONDS:g} s")
    return " · ".join(parts)


def describe_now(status: EngineStatus, compile_wait: CompileWait | None) -> str:
    """The line under the buttons, in every browser: what the device does now and so what a new request waits for."""
    if compile_wait is not None:
        doing = compile_wait.describe(time.monotonic())[1]
    else:
        compiling = [s.layout or s.resolution for s in [*status.shapes, *status.layouts] if s.state == COMPILING]
        doing = f"compiling {', '.join(compiling)} (a warm-up)" if compiling else "making an image"
    if not status.busy and compile_wait is None:
        return ""
    waiting = f"; {status.queue_depth} request{'s' if status.queue_depth != 1 else ''} waiting" \
        if status.queue_depth else ""
    return f"**Now on the device:** {doing}{waiting}. A new request waits for it."


def describe_prompt(text: str, tokens: int, limit: int, first_ignored: str | None = None) -> str:
    """The prompt's length against what the text encoder reads (its first `limit` tokens) and the box's cap."""
    chars = f"{len(text)}/{MAX_PROMPT_CHARS} characters"
    if len(text) >= MAX_PROMPT_CHARS:
        chars = f"**{MAX_PROMPT_CHARS}/{MAX_PROMPT_CHARS} characters: the box takes no more**"
    if tokens <= limit:
        return f"{tokens}/{limit} tokens (the text encoder reads {limit}) · {chars}"
    where = f" from “{first_ignored}”" if first_ignored else ""
    return (f"**{tokens}/{limit} tokens: the text encoder reads only the first {limit}; the words{where} on are "
            f"ignored** · {chars}")


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


@dataclass
class CompileWait:
    """A compilation in progress as one request reported it: what, since when, and for about how long."""

    message: str  # the engine's words, e.g. "compiling 1344x768 for the first time (about 41 s)"
    phase: str | None
    estimate: float | None
    guess: bool
    started: float

    def describe(self, now: float) -> tuple[float | tuple[int, None], str]:
        """The progress bar's value and words: elapsed against the estimate, labelled as an estimate (or a guess)."""
        elapsed = now - self.started
        head = self.message.split(" (")[0]  # the engine's words without its "(about N s)"
        phase = f"{self.phase}: " if self.phase and not head.startswith(self.phase) else ""
        if self.estimate is None:
            return (int(elapsed), None), f"{phase}{head} · {elapsed:.0f} s so far (time not measured yet)"
        label = GUESS if self.guess else "estimate"
        fraction = min(elapsed / self.estimate, 0.99) if self.estimate > 0 else 0.99
        return fraction, f"{phase}{head} · {elapsed:.0f} s of about {self.estimate:.0f} s ({label})"


class ProgressReporter:
    """Maps the engine's ProgressUpdate onto gr.Progress: waiting, compiling, steps, decoding.

    A compile reports once, at its start, then blocks for its whole length: a ticker thread re-reports it every
    TICK_SECONDS with the time elapsed against the estimate, so the bar moves and says how long (it sat at 0.0%).
    `on_compile` hears the compile start (a CompileWait) and end (None), for the line every browser sees.
    Use it as a context manager, so the ticker stops when the request ends, however it ends.
    """

    def __init__(self, progress: Callable[..., Any], prefix: str = "",
                 on_compile: Callable[[CompileWait | None], None] | None = None):
        self.progress = progress
        self.prefix = prefix
        self.on_compile = on_compile or (lambda wait: None)
        self.compile: CompileWait | None = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __call__(self, update: ProgressUpdate) -> None:
        self._stop_ticker()
        if update.stage == "compiling":
            started = self.compile.started if self.compile else time.monotonic()  # a new phase of the same wait
            self.compile = CompileWait(update.message, update.phase, update.estimate_seconds, update.guess, started)
            self.on_compile(self.compile)
            self._show_compile()
            self._stop = threading.Event()
            # gr.Progress finds its request through context variables: the ticker runs in a copy of this context.
            context = contextvars.copy_context()
            self._ticker = threading.Thread(target=context.run, args=(self._tick, self._stop),
                                            name="compile-progress", daemon=True)
            self._ticker.start()
            return
        if self.compile is not None:
            self.compile = None
            self.on_compile(None)
        # Gradio shows no text for a None fraction, so a stage of unknown length shows as 0%.
        self.progress(update.fraction or 0.0, desc=self.prefix + update.message)

    def close(self) -> None:
        self._stop_ticker()
        if self.compile is not None:
            self.compile = None
            self.on_compile(None)

    def _show_compile(self) -> None:
        wait = self.compile
        if wait is not None:
            value, words = wait.describe(time.monotonic())
            self.progress(value, desc=self.prefix + words, unit="s")

    def _tick(self, stop: threading.Event) -> None:
        while not stop.wait(TICK_SECONDS):
            self._show_compile()

    def _stop_ticker(self) -> None:
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join(timeout=2)
        self._ticker = None


def progress_reporter(progress: Callable[..., Any], prefix: str = "") -> ProgressFn:
    """A ProgressReporter without a compile listener (the CLI-style callers and tests)."""
    return ProgressReporter(progress, prefix)


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

    def __init__(self, engine: EngineLike, store: ImageStore, waiting: Callable[[], int] | None = None,
                 held: sessions.HeldResults | None = None, uploads: Path | None = None):
        self.engine = engine
        self.store = store
        self.waiting = waiting or (lambda: 0)  # requests in Gradio's queue, not yet in the engine
        self.stops = SessionStops()  # the running requests of each Gradio session, for Stop, /stop and disconnects
        self.distilled = engine.status().distilled
        self.held = held or sessions.HeldResults()  # results a reloaded page comes back for
        self.uploads = uploads or store.folder  # Gradio's folder: the only files a browser's session may name
        self.compile_wait: CompileWait | None = None  # the compile a request here waits for (one device)

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

    def _make(self, request: GenerateRequest, progress: Callable[..., Any], prefix: str = "",
              session: Any = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Generate, save the PNG, and return the history entry for it, held for the session's page too (it may
        have reloaded by the time the image is done). `extra` joins the entry (the inpaint editor's value)."""
        sid = sessions.session_id(session)
        self.held.start(sid, request.resolution if isinstance(request.resolution, str) else "")
        try:
            with (user_errors(), ProgressReporter(progress, prefix, self._on_compile) as reporter,
                  self.stops.track(*current_event()) as stop):
                result = self.engine.generate(request, progress=reporter, stop=stop)
                path = self.store.save(result)  # a full disk is told like any other server failure
        except gr.Error as error:
            self.held.fail(sid, error.message)
            raise
        entry = {
            "path": path,
            "info": describe_result(result, show_guidance=not self.distilled) + editing.describe_inputs(result),
            "cache_event": result.cache_event,
            "made": time.time(),
            **{key: getattr(result, key) for key in ("prompt", "resolution", "steps", "seed", "guidance", "mode",
                                                     "strength")},
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
                    progress: gr.Progress = gr.Progress()):
        """One image from the form; the seed box then shows the seed actually used."""
        request = self._request(prompt, resolution, steps, None if randomize else seed, guidance, references,
                                reference_size, fit)
        return self.run(request, history, progress, session)

    def run(self, request: GenerateRequest, history: list[dict[str, Any]], progress: Callable[..., Any],
            session: Any = None, extra: dict[str, Any] | None = None):
        """One request (generate or inpaint) into the Generate button's outputs."""
        entry = self._make(request, progress, session=session, extra=extra)
        history = self._remember(entry, history)
        return entry["path"], entry["info"], entry["seed"], history, gallery_items(history)

    def on_variations(self, prompt: str, resolution: str, steps: float, seed: float | None, randomize: bool,
                      guidance: float, count: float, history: list[dict[str, Any]], session: Any = None,
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
            request = self._request(prompt, resolution, steps, next_seed, guidance)
            entry = self._make(request, progress, prefix=f"image {index + 1}/{count}: ", session=session)
            first = entry["seed"] if index == 0 else first
            gallery.append((entry["path"], f"seed {entry['seed']}"))
            history = self._remember(entry, history)
            yield entry["path"], entry["info"], entry["seed"], list(gallery), history, gallery_items(history)

    def on_warmup(self, resolution: str, progress: gr.Progress = gr.Progress()) -> str:
        """Compile the chosen size now, so the first image at it is fast."""
        with user_errors(), ProgressReporter(progress, on_compile=self._on_compile) as reporter:
            return describe_size(self.engine.warmup(resolution, progress=reporter))

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

    def on_failed(self, session: Any) -> str:
        """The line under the image after an error: it says the error, never the previous image's parameters."""
        error = self.held.take_error(sessions.session_id(session))
        why = f" {error}" if error else " The message says why."
        return f"**Not made:**{why} (The image above, if any, is the one before.)"

    def on_prompt(self, text: str | None) -> str:
        """The prompt's tokens against what the text encoder reads, and its characters against the box's cap."""
        text = text or ""
        if not text.strip():
            return ""
        tokens, limit = self.engine.prompt_tokens(text)
        return describe_prompt(text, tokens, limit, self._first_ignored_word(text, limit) if tokens > limit else None)

    def _first_ignored_word(self, text: str, limit: int) -> str | None:
        """The first word past what the text encoder reads (a binary search over word ends: a few tokenizer calls)."""
        words = list(re.finditer(r"\S+", text))
        low, high = 0, len(words)
        while low < high:
            middle = (low + high) // 2
            if self.engine.prompt_tokens(text[: words[middle].end()])[0] > limit:
                high = middle
            else:
                low = middle + 1
        return words[low].group()[:40] if low < len(words) else None

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

    def on_stop(self, request: gr.Request) -> str:
        """Stop this browser's image at the next step, or take it out of the queue; the line says which."""
        return describe_stop(self.stops.stop(request.session_hash))

    def on_resolution(self, resolution: str) -> str:
        return self._size_hint(self.engine.status(), resolution)

    def on_tick(self, resolution: str, last: Any):
        """Status table, activity line, dropdown labels, hint and the line of what the device does now, for every
        open browser; skipped when unchanged (a compile's elapsed seconds change it every tick)."""
        status = self.status()
        now = describe_now(status, self.compile_wait)
        signature = {**status.to_dict(), "now": now}
        if signature == last:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip(), last
        return (status_rows(status), describe_activity(status), gr.Dropdown(choices=resolution_choices(status)),
                self._size_hint(status, resolution), now, signature)

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
            with self.stops.track(*current_event()) as stop:
                result = self.engine.generate(request, stop=stop)
            return self.store.save(result), result.info()

    def api_warmup(self, resolution: str) -> dict[str, Any]:
        """Compile one preset without making an image; returns its status."""
        with user_errors():
            return asdict(self.engine.warmup(resolution))

    def api_stop(self, request: gr.Request) -> dict[str, Any]:
        """Stop this client's requests (its session): a running image at the next step, a queued one at once."""
        phases = self.stops.stop(request.session_hash)
        return {"stopped": phases, "message": describe_stop(phases).replace("**", "")}

    def api_status(self) -> dict[str, Any]:
        """The engine status: every preset's state, compile seconds, hits and last latency."""
        return public_status(self.status())


# -- layout and wiring ----------------------------------------------------------------------------------


def current_event() -> tuple[str | None, str | None]:
    """The Gradio session and event this handler runs for (None, None outside an event).

    Gradio sets them in context variables around every handler (gradio/utils.py, before_fn); they key the
    request's StopToken, so Stop, /stop and a client's cancel or disconnect find it. tests/test_stop_api.py fails
    if Gradio moves them."""
    from gradio.context import LocalContext

    request = LocalContext.request.get(None)
    return getattr(request, "session_hash", None), LocalContext.event_id.get(None)


def session_stops(demo: gr.Blocks) -> SessionStops:
    """The demo's registry of running requests by session (the Handlers' own), for the server's gate."""
    return next(fn.fn.__self__.stops for fn in demo.fns.values() if fn.api_name == "stop")


def device_events(demo: gr.Blocks) -> int:
    """Device events Gradio has accepted and not finished: its queue, and the ones running (each waits in the
    engine's queue or holds the device). doors.Gate bounds this by --max-queue + 1."""
    try:
        event_queue = demo._queue.event_queue_per_concurrency_id.get(DEVICE)
        return 0 if event_queue is None else len(event_queue.queue) + event_queue.current_concurrency
    except AttributeError:
        return device_queue_length(demo)


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
    # Gradio's queue is read at event time, from the demo built below (the closure binds `demo` late).
    handlers = Handlers(engine, ImageStore(), waiting=lambda: device_queue_length(demo),
                        uploads=private_file_folder())
    first = str(engine.presets[0])
    with gr.Blocks(title="neuron-ui · FLUX.2-klein", analytics_enabled=False) as demo:
        history, seen = gr.State([]), gr.State(None)
        # The form and history in the browser (a reload or a new tab finds them), with this session's id.
        session = gr.BrowserState({}, storage_key=sessions.STORAGE_KEY)
        gr.Markdown(f"# neuron-ui · FLUX.2-klein\n{describe_engine(status, settings)}", elem_id="header")
        if status.is_tiny:
            gr.Markdown(tiny_banner(status), elem_id="tiny-banner")
        if status.cache_error:
            gr.Markdown("Compiled sizes will not survive a restart: the compile cache is not persistent here.",
                        elem_id="cache-warning")
        # On a phone (assets/style.css) #controls dissolves, so the image comes right after #form's button.
        with gr.Row(equal_height=False, elem_id="main-row"):
            with gr.Column(scale=2, min_width=340, elem_id="controls"):
                with gr.Column(elem_id="form"):
                    prompt = gr.Textbox(label="Prompt", placeholder="Describe the image, then press Enter",
                                        lines=1, max_lines=4, max_length=MAX_PROMPT_CHARS, elem_id="prompt",
                                        autofocus=True)
                    prompt_count = gr.Markdown(elem_id="prompt-count")
                    resolution = gr.Dropdown(resolution_choices(status), value=first, label="Resolution",
                                             elem_id="resolution")
                    hint = gr.Markdown(describe_size(status.shape(first)), elem_id="size-hint")
                    with gr.Row():
                        generate = gr.Button("Generate", variant="primary", elem_id="generate")
                        stop = gr.Button("Stop", variant="stop", elem_id="stop")
                        warmup = gr.Button("Warm up this size", elem_id="warmup")
                    now = gr.Markdown(describe_now(status, None), elem_id="device-now")
                with gr.Column(elem_id="form-more"):
                    with gr.Row(equal_height=False, elem_id="variations-row"):
                        count = gr.Radio(list(range(1, MAX_VARIATIONS + 1)), value=MAX_VARIATIONS, scale=2,
                                         label="Variations", info="same prompt, consecutive seeds", elem_id="count")
                        make_variations = gr.Button("Make variations", scale=1, elem_id="make-variations")
                    with gr.Accordion("Advanced", open=False, elem_id="advanced"):
                        steps = gr.Slider(1, MAX_STEPS, value=status.default_steps, step=1, label="Steps",
                                          info=f"the model's default is {status.default_steps}", elem_id="steps")
                        with gr.Row(equal_height=True):
                            seed = gr.Number(label="Seed", precision=0, minimum=0, maximum=MAX_SEED, scale=2,
                                             info="typing one unticks Randomize", elem_id="seed")
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
            with gr.Column(scale=3, min_width=340, elem_id="result"):
                image = gr.Image(label="Image", type="filepath", format="png", interactive=False, height=440,
                                 buttons=["download", "fullscreen"], elem_id="image")
                info = gr.Markdown(elem_id="info")
                edit_result = editing.add_result_buttons()
                layout_hint = gr.Markdown(elem_id="layout-hint")
                variations = gr.Gallery(label="Variations", columns=MAX_VARIATIONS, fit_columns=False, height="auto",
                                        visible=False, elem_id="variations")
                history_gallery = gr.Gallery(label="History: click an image to restore its settings", columns=6,
                                             fit_columns=False, height="auto", allow_preview=False,
                                             elem_id="history")
        with gr.Accordion("Sizes on this server", open=True, elem_id="status"):
            table = gr.Dataframe(status_rows(status), headers=TABLE_HEADERS, interactive=False,
                                 elem_id="status-table")
            gr.Markdown(TABLE_LEGEND, elem_id="table-legend")
            activity = gr.Markdown(describe_activity(status), elem_id="activity")
        timer = gr.Timer(REFRESH_SECONDS)

        # Every event that runs the pipeline: admitted up to --max-queue waiting plus the one on the device (doors.Gate
        # bounds it), each then waits in the engine's queue, where it hears what it waits for, can be stopped, and
        # the next image starts on the device while the previous one is encoded and sent.
        on_device = {"concurrency_id": DEVICE, "concurrency_limit": settings.max_queue + 1}
        private = {"api_visibility": "private"}
        hidden = {"show_progress": "hidden", "queue": False, **private}
        refresh = {"fn": handlers.on_tick, "inputs": [resolution, seen],
                   "outputs": [table, activity, resolution, hint, now, seen], **hidden}
        failed = {"fn": handlers.on_failed, "inputs": [session], "outputs": [info], **hidden}
        form = [prompt, resolution, steps, seed, randomize, guidance]
        ref_inputs = [edit_refs["files"], edit_refs["size"], edit_refs["fit"]]
        made = [image, info, seed, history, history_gallery]
        generated = gr.on([generate.click, prompt.submit], handlers.on_generate,
                          [*form, history, *ref_inputs, session], made, show_progress_on=[image], **on_device,
                          **private)
        generated.then(**refresh)
        generated.failure(**failed)
        varied = make_variations.click(lambda: gr.Gallery(value=[], visible=True), None, variations, queue=False,
                                       **private).then(
            handlers.on_variations, [*form, count, history, session],
            [image, info, seed, variations, history, history_gallery],
            show_progress_on=[image, variations], **on_device, **private)
        varied.then(**refresh)
        varied.failure(**failed)
        warmup.click(handlers.on_warmup, [resolution], [hint], **on_device, **private).then(**refresh)
        resolution.change(handlers.on_resolution, [resolution], [hint], **hidden)
        seed.input(handlers.on_seed_typed, [seed], [randomize], **hidden)
        prompt.change(handlers.on_prompt, [prompt], [prompt_count], trigger_mode="always_last", **hidden)
        timer.tick(**refresh)
        # A reload or a new tab: the form, the history and any image finished meanwhile come back.
        collect = gr.Timer(REFRESH_SECONDS, active=False)
        demo.load(handlers.on_restore, [session], [session, *form, history, history_gallery, image, info, collect],
                  **hidden).then(**refresh)
        collect.tick(handlers.on_collect, [session, history], [*made, collect], **hidden)
        gr.on([c.change for c in [*form, history]], handlers.on_save, [session, *form, history], [session],
              trigger_mode="always_last", **hidden)
        editing_handlers = editing.EditingHandlers(engine, handlers.run, handlers.store.save, user_errors,
                                                   handlers.distilled)
        history_gallery.select(handlers.on_select, [history],
                               [prompt, resolution, steps, seed, randomize, image, info, *ref_inputs,
                                edit_inpaint["editor"], edit_inpaint["strength"]], **hidden)
        reuse.click(handlers.on_reuse_seed, [history], [seed, randomize], **hidden)
        layout_inputs = [resolution, edit_refs["files"], edit_refs["size"]]
        gr.on([edit_refs["files"].change, edit_refs["size"].change, edit_refs["fit"].change],
              editing_handlers.on_preview, ref_inputs, edit_refs["previews"], **hidden)
        gr.on([edit_refs["files"].change, edit_refs["size"].change, resolution.change, generate.click],
              editing_handlers.on_layout, layout_inputs, layout_hint, **hidden)
        edit_result["use"].click(editing_handlers.on_use_as_reference, [image, edit_refs["files"]],
                                 edit_refs["files"], **hidden)
        edit_result["edit"].click(editing_handlers.on_edit_image, [image], [edit_inpaint["editor"], inpaint_panel],
                                  **hidden)
        inpainted = edit_inpaint["button"].click(
            editing_handlers.on_inpaint,
            [edit_inpaint["editor"], prompt, resolution, edit_inpaint["strength"], steps, seed, randomize, guidance,
             *ref_inputs, history, session],
            made, show_progress_on=[image], **on_device, **private,
        )
        inpainted.then(**refresh)
        inpainted.failure(**failed)
        # Stop: the engine stops this session's image at the next step (cancels= alone leaves the thread running).
        stop.click(handlers.on_stop, None, info, cancels=[generated, varied, inpainted], queue=False, **private)

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
        gr.api(handlers.api_stop, api_name="stop", concurrency_limit=None)
    return demo
