"""The engine's front: the one engine interface (contract.engine_like.EngineLike) whatever makes the images.

Knows nothing of Gradio. It checks each request's layout, gives the device its turns (visitors in turn, users before
background warm-up), tells a waiting user what is ahead, keeps the warm-up list, the status and the observers; its
runner (DeviceRunner, below) makes the images: the pipeline on this process's device (engine.local) or a Ray
Serve replica (replicas.runner), as many at once as the runner has slots.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from neuron_ui.contract.errors import EngineError, ErrorKind
from neuron_ui.contract.layouts import Layout
from neuron_ui.contract.requests import require_inpaint_inputs
from neuron_ui.contract.stopping import Phase, StopToken
from neuron_ui.engine.device_queue import DeviceQueue
from neuron_ui.engine.waiting import WAIT_WORTH_TELLING, DeviceWatch, Wait

if TYPE_CHECKING:
    from neuron_ui.contract.engine_like import Health, Observers
    from neuron_ui.config.resolutions import Resolution
    from neuron_ui.contract.layouts import Layouts
    from neuron_ui.contract.requests import GenerateRequest
    from neuron_ui.contract.results import EngineStatus, GenerateResult, ProgressFn, ProgressUpdate, ShapeStatus

logger = logging.getLogger(__name__)

Job = TypeVar("Job")  # a request as the runner runs it, from prepare() to make()


class DeviceRunner(Protocol[Job]):
    """The device side of an engine. `slots`: images it makes at once (the front's queue lets that many through);
    `allowed`: the layouts it makes; `observers`: told of its compiles (the front tells them of images and failures).
    Errors: ValueError for bad input, EngineError (one line) for failures."""

    slots: int
    allowed: Layouts
    observers: Observers

    def prepare(self, request: GenerateRequest, layout: Layout) -> Job:
        """Before the queue: what make() runs (every field checked: ValueError names what is allowed)."""

    def make(self, job: Job, layout: Layout, report: ProgressFn, stop: StopToken, watch: DeviceWatch) -> GenerateResult:
        """In its turn: the image of a prepared request, compiling its layout first where needed; `watch` hears what
        holds the device, for the users waiting behind it."""

    def warm(self, layout: Layout, report: ProgressFn, watch: DeviceWatch) -> None:
        """In its turn: compile a layout without making an image."""

    def compile_left(self, layout: Layout) -> float | None:
        """Seconds a request at `layout` would compile before its image: 0.0 when held, None when unknown."""

    def shape(self, layout: Layout, warmup: list[Layout]) -> ShapeStatus:
        """One layout's state (`warmup`: the layouts still to warm up)."""

    def used(self) -> list[Layout]:
        """The editing layouts used or warmed up, for the status's layouts section."""

    def status(self) -> EngineStatus:
        """The runner's part of the status (facts, cache, tensor parallelism, styles, replicas); the front fills in
        its queue, warm-up list and sizes."""

    def prompt_tokens(self, text: str) -> tuple[int, int]: ...

    def health(self) -> Health: ...

    def close(self) -> None:
        """Shutting down: what waits beyond the front's queue hears so (a replica's router); nothing new starts."""


def _ignore(update: ProgressUpdate) -> None:
    pass


class Engine(Generic[Job]):
    """The front of one runner behind the engine interface: one request per runner slot on the device at a time,
    visitors in turn (`max_queue_per_user` each), users before background warm-up."""

    def __init__(self, runner: DeviceRunner[Job], max_queue_per_user: int | None = None):
        self.runner = runner
        self.allowed = runner.allowed
        self.presets: tuple[Resolution, ...] = runner.allowed.presets
        self.max_references = runner.allowed.max_references
        self.reference_sizes: tuple[Resolution, ...] = runner.allowed.reference_sizes
        self.observers = runner.observers  # the runner tells them its compiles; the front, images and failures
        # Answered as the runner (and its layouts) answer: the layout a request would make (ValueError names what is
        # allowed), the tokens the text encoder gets for a prompt and how many it reads, /healthz once serving.
        self.layout = self.allowed.layout
        self.prompt_tokens = runner.prompt_tokens
        self.health = runner.health
        self.queue = DeviceQueue(max_queue_per_user, slots=runner.slots)  # visitors take turns (engine.device_queue)
        self._watch = DeviceWatch(runner.compile_left, slots=runner.slots)
        self._lock = threading.Lock()
        self._warmups: list[Layout] = []  # to compile in the background, the one compiling now first
        self._warming: threading.Thread | None = None  # the one thread that compiles them, one after another

    def inpaint(self, request: GenerateRequest, progress: ProgressFn | None = None,
                stop: StopToken | None = None) -> GenerateResult:
        """Redo the masked part of `request.image`; a request without image and mask is refused."""
        with self._counting_failures():
            require_inpaint_inputs(request)
        return self.generate(request, progress, stop)

    def generate(self, request: GenerateRequest, progress: ProgressFn | None = None,
                 stop: StopToken | None = None) -> GenerateResult:
        """Make one image, compiling its shape first where needed; `stop` ends it early (Stopped)."""
        with self._counting_failures():
            result = self._generate(request, progress or _ignore, stop or StopToken())
        self.observers.generated(result)
        return result

    @contextmanager
    def _counting_failures(self) -> Iterator[None]:
        """Tell the observers why a request failed: invalid (ValueError) or the engine's own kind."""
        try:
            yield
        except ValueError:
            self.observers.failed(ErrorKind.INVALID_REQUEST)
            raise
        except EngineError as error:
            self.observers.failed(error.kind)
            raise

    def _generate(self, request: GenerateRequest, report: ProgressFn, stop: StopToken) -> GenerateResult:
        # 1. Layout: the static shape this request makes, so one graph per sequence length.
        layout = self.layout(request.resolution, len(request.references), request.reference_size,
                             inpaint=request.image is not None or request.mask is not None)
        # 2. Validate the rest: every value checked, defaults filled in, input images fitted to the layout (ValueError
        # names the fix).
        job = self.runner.prepare(request, layout)
        stop.enter(Phase.QUEUED)  # admitted: the caller may now hold the request for its session (StopToken.enter)
        # 3. Queue: one run per slot at a time, visitors in turn; a waiting user hears what is ahead, how long.
        waited, queued = Wait(), time.perf_counter()
        with self.queue.user(stop, job=layout, visitor=request.visitor,
                               on_wait=lambda ahead, mine: report(self._watch.describe(ahead, waited, mine))):
            start = time.perf_counter()
            # 4-6. Compile where needed, run, and the result (the runner's).
            result = self.runner.make(job, layout, report, stop, self._watch)
        wait = start - queued  # the front's wait, before any the runner counted (a lost replica's)
        return replace(result, waited_seconds=round(wait + result.waited_seconds, 3),
                       waited_for=result.waited_for or (waited.what if wait >= WAIT_WORTH_TELLING else None))

    def warmup(self, resolution: str, progress: ProgressFn | None = None, *, references: int = 0,
               reference_size: str | None = None, inpaint: bool = False, visitor: str | None = None) -> ShapeStatus:
        """Compile one preset (or one of its editing layouts) without making an image, before anyone asks."""
        with self._counting_failures():
            layout = self.layout(resolution, references, reference_size, inpaint)
            with self.queue.user(job=layout, visitor=visitor):
                self.runner.warm(layout, progress or _ignore, self._watch)
        return self.layout_status(layout)

    def start_warmup(self, resolutions: list[str]) -> None:
        """Compile these presets in the background, each listed until it is done; any user request goes first."""
        layouts = [self.layout(r) for r in resolutions]
        with self._lock:
            self._warmups.extend(layout for layout in layouts if layout not in self._warmups)
            if self._warming is None or not self._warming.is_alive():
                self._warming = threading.Thread(target=self._warm_all, name="warmup", daemon=True)
                self._warming.start()

    def _warm_all(self) -> None:
        """The warm-up list, one layout at a time when the device is free of users, until it is empty or the device
        is closed (shutting down: the rest is not compiled)."""
        go_on = True
        while go_on:
            with self._lock:
                if not self._warmups:
                    self._warming = None  # under the lock: a layout added from now on starts a thread of its own
                    return
                layout = self._warmups[0]
            try:
                with self.queue.background():
                    try:
                        self.runner.warm(layout, _ignore, self._watch)
                    except (ValueError, EngineError) as error:  # recorded as failed in the status; the next goes on
                        logger.warning("warm-up of %s failed: %s", layout, error)
            except EngineError:  # the device is closed
                go_on = False
            finally:
                with self._lock:
                    self._warmups.remove(layout)
                    if not go_on:
                        self._warmups.clear()

    def _pending(self) -> list[Layout]:
        with self._lock:
            return list(self._warmups)

    def drain(self, timeout: float) -> bool:
        """Shutting down: refuse new requests ("the server is shutting down"), tell the waiting ones so (at the front
        and beyond it), and wait up to `timeout` s for the runs on the device; True if they finished."""
        self.queue.close(0)
        self.runner.close()
        return self.queue.close(timeout)

    def layout_status(self, layout: Layout) -> ShapeStatus:
        """One layout's state, e.g. for the line under the form before the click."""
        return self.runner.shape(layout, self._pending())

    def status(self) -> EngineStatus:
        """A snapshot for the UI's status table and the /status API; never waits for the device."""
        warmup = self._pending()
        shapes = [self.runner.shape(Layout(preset), warmup) for preset in self.presets]
        return replace(
            self.runner.status(),
            busy=self.queue.busy,
            queue_depth=self.queue.waiting,
            visitors_waiting=self.queue.visitors_waiting,
            warmup_queue=[str(layout) for layout in warmup],
            warmup_seconds_left=round(sum(s.estimate_seconds or 0.0 for s in shapes if s.warmup_queued), 1),
            shapes=shapes,
            layouts=[self.runner.shape(layout, warmup) for layout in self.runner.used()],
            reference_sizes=[str(r) for r in self.reference_sizes],
            max_references=self.max_references,
        )
