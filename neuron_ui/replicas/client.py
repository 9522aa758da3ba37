"""ReplicaClient: the engine interface (EngineLike) over a Ray Serve deployment of engine replicas, the one class
of this package the rest of the app sees. It validates and routes each request by its layout (the calls go through
neuron_ui.replicas.stream), and merges the replicas' reports (neuron_ui.replicas.watcher) into one status.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from neuron_ui.contract import references as refs
from neuron_ui.contract.engine_like import Observers
from neuron_ui.contract.errors import EngineError, ErrorKind
from neuron_ui.images.decode import read_file
from neuron_ui.contract.layouts import Layout, Layouts
from neuron_ui.contract.lifecycle import ServesOnceBuilt
from neuron_ui.contract.requests import count_prompt_tokens, require_inpaint_inputs
from neuron_ui.engine.device_queue import DeviceQueue
from neuron_ui.engine.warmup import WarmupList
from neuron_ui.replicas.board import APP_NAME, STALE_SECONDS, ReplicaReport, Reports
from neuron_ui.replicas.status import build_book, merge_layout, replica_rows
from neuron_ui.replicas.routing import ShapeRouting
from neuron_ui.replicas.stream import SHUTTING_DOWN, StreamCaller
from neuron_ui.replicas.timing import Timing, now
from neuron_ui.replicas.turn_words import describe_turn
from neuron_ui.replicas.watcher import ReplicaWatcher

if TYPE_CHECKING:
    from neuron_ui.config.resolutions import Resolution
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.requests import GenerateRequest
    from neuron_ui.contract.results import EngineStatus, GenerateResult, ProgressFn, ShapeStatus
    from neuron_ui.contract.stopping import StopToken
    from neuron_ui.engine.graphs import GraphBook
    from neuron_ui.replicas.plan import ReplicaPlan

logger = logging.getLogger(__name__)


class ReplicaClient(ServesOnceBuilt):
    """What the UI and the server use of an Engine (neuron_ui.contract.engine_like.EngineLike), served by replicas.

    Errors are the engine's: ValueError for bad input, EngineError (one line) for failures. A request whose
    replica dies is sent once more, with the same seed, to another replica (neuron_ui.replicas.stream). A watcher
    thread reads the replicas' reports (neuron_ui.replicas.watcher), so status() and /healthz never wait for Ray."""

    def __init__(self, handle: Any, board: Any, settings: Settings, plan: ReplicaPlan, app_name: str = APP_NAME,
                 watcher: ReplicaWatcher | None = None, clock: Callable[[], float] = time.perf_counter,
                 grpc: bool = False):
        """`watcher` reads the replicas' reports (by default the board's and Serve's, on Ray); `clock` measures the
        time a request lost on a replica that died; `grpc`: calls over Serve's gRPC (neuron_ui.replicas.stream)."""
        self.board = board
        self.plan = plan
        self.app_name = app_name
        self.presets = settings.resolutions
        self.max_references = settings.max_references
        self.reference_sizes = refs.REFERENCE_SIZES
        self.allowed = Layouts(self.presets, self.reference_sizes, self.max_references)
        self.manifest_path = Path(settings.cache_dir).expanduser().resolve() / "manifest.json"
        self.observers = Observers()
        self.calls = StreamCaller(handle, self.observers, clock, ShapeRouting(plan.replicas), grpc)
        # The front decides who goes next: visitors in turn, as many at once as there are replicas (each makes one
        # image at a time); the deployment then routes each by its shape.
        self.turns = DeviceQueue(settings.max_queue_per_user, slots=plan.replicas)
        self._closed = False
        self._last: EngineStatus | None = None
        self._tokenizer: Any = None
        self._warmups: WarmupList[str] = WarmupList(self._warm_one)
        self.watcher = watcher or ReplicaWatcher.on_ray(board, app_name)
        self.startup: dict[str, float] = {}  # seconds per stage of the launch (neuron_ui.replicas.launch)

    # -- requests ----------------------------------------------------------------------------------------

    def layout(self, resolution: str, references: int = 0, reference_size: str | None = None,
               inpaint: bool = False) -> Layout:
        return self.allowed.layout(resolution, references, reference_size, inpaint)

    def generate(self, request: GenerateRequest, progress: ProgressFn | None = None,
                 stop: StopToken | None = None) -> GenerateResult:
        """One image on the replica that holds its graph; a fixed seed, so a retry makes the same image.
        `stop` cancels the request's stream, which stops it on its replica at the next step (Stopped here)."""
        timing = Timing(called=now())
        try:
            layout = self.layout(request.resolution, len(request.references), request.reference_size,
                                 inpaint=request.image is not None or request.mask is not None)
            request = portable(request)
        except ValueError:
            self.observers.failed(ErrorKind.INVALID_REQUEST)
            raise
        if request.seed is None:
            request = replace(request, seed=secrets.randbelow(2**32))
        try:
            result = self._call("generate", request, layout, progress, stop, request.visitor, timing)
        except EngineError as error:
            if error.kind is ErrorKind.VISITOR_QUEUE_FULL:  # refused at the front: counted here, as the engine does
                self.observers.failed(error.kind)
            raise
        self.observers.generated(result)
        return result

    def prompt_tokens(self, text: str) -> tuple[int, int]:
        """Counted here, with the tokenizer a replica shared once (a call to a replica would wait behind images)."""
        if self._tokenizer is None:
            self._tokenizer = ray.get(self.board.tokenizer.remote(), timeout=10)
        if self._tokenizer is None:
            raise EngineError("no replica has shared its tokenizer yet", kind=ErrorKind.NO_REPLICA)
        return count_prompt_tokens(self._tokenizer, text)

    def inpaint(self, request: GenerateRequest, progress: ProgressFn | None = None,
                stop: StopToken | None = None) -> GenerateResult:
        """Redo the masked part of `request.image`; a request without image and mask is refused."""
        try:
            require_inpaint_inputs(request)
        except ValueError:
            self.observers.failed(ErrorKind.INVALID_REQUEST)
            raise
        return self.generate(request, progress, stop)

    def warmup(self, resolution: str, progress: ProgressFn | None = None, *,
               visitor: str | None = None) -> ShapeStatus:
        """Compile one preset on one replica; the others load it from the cache when asked for it."""
        layout = self.layout(resolution)
        self._call("warmup", str(layout), layout, progress, visitor=visitor)
        return self.layout_status(layout)

    def start_warmup(self, resolutions: list[str]) -> None:
        """Warm these presets up one after another in the background, each compiled once in the deployment."""
        self._warmups.add([str(self.layout(r)) for r in resolutions])

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        return self._warmups.wait(timeout)

    def drain(self, timeout: float) -> bool:
        """Shutting down, as the engine does: no new requests from this front, the ones waiting for a replica hear
        "shutting down", the ones running on a replica may finish within `timeout`; True if they did."""
        self._closed = True
        self.turns.close(0)  # whoever waits at the front hears "shutting down" now
        self.calls.close()
        deadline = time.monotonic() + timeout
        while self.calls.started() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.watcher.stop()
        return not self.calls.started()

    def _warm_one(self, resolution: str) -> bool:
        if self._closed:
            return False
        try:
            layout = self.layout(resolution)
            with self.turns.background():  # only while no visitor waits at the front
                self.calls.call("warmup", str(layout), layout, None)
        except (ValueError, EngineError) as error:
            logger.warning("warm-up of %s failed: %s", resolution, error)
        return True

    def _call(self, method: str, argument: Any, layout: Layout, progress: ProgressFn | None,
              stop: StopToken | None = None, visitor: str | None = None, timing: Timing | None = None) -> Any:
        """One call to the deployment once its visitor's turn comes at the front."""
        if self._closed:
            raise EngineError(SHUTTING_DOWN, kind=ErrorKind.SHUTTING_DOWN)
        report = progress or (lambda update: None)
        timing = timing or Timing(called=now())
        with self.turns.user(stop, job=layout, visitor=visitor,
                             on_wait=lambda ahead, mine: report(describe_turn(ahead, mine, self.watcher.healthy()))):
            timing.turn = now()
            return self.calls.call(method, argument, layout, progress, stop, timing)

    # -- status ------------------------------------------------------------------------------------------

    def reports(self) -> Reports:
        """Each replica's last report and its age in seconds, as the watcher last read them; busy also where a call
        of this front runs on it now (a replica reports busy at its next tick, not as the image starts)."""
        running = set(self.calls.routing.running())
        return {key: (age, replace(report, busy=True) if report.replica in running else report)
                for key, (age, report) in self.watcher.reports().items()}

    def wait_for_replicas(self, count: int, timeout: float) -> None:
        self.watcher.wait_for(count, timeout)

    def layout_status(self, layout: Layout) -> ShapeStatus:
        """One layout over all healthy replicas, e.g. for the line under the editing form before the click."""
        healthy = self.watcher.healthy()
        if not healthy:
            raise EngineError("no replica is answering; try again in a minute", kind=ErrorKind.NO_REPLICA)
        return self._merge(layout, healthy, build_book(healthy[0], self.manifest_path), self.warmup_presets())

    def warmup_presets(self) -> list[Resolution]:
        return [self.allowed.layout(r).resolution for r in self._warmups.pending()]

    def _merge(self, layout: Layout, healthy: list[ReplicaReport], book: GraphBook,
               warmup: list[Resolution]) -> ShapeStatus:
        return merge_layout(layout, healthy, book, warmup, self.plan.replicas)

    def status(self) -> EngineStatus:
        """One status over all replicas: each size ready on k of N, and a section per replica."""
        reports = self.reports()
        healthy = [report for age, report in reports.values() if age < STALE_SECONDS]
        if not healthy:
            if self._last is None:
                raise EngineError("no replica has reported yet", kind=ErrorKind.NO_REPLICA)
            return replace(self._last, busy=False, replicas=replica_rows(reports, self.plan.replicas),
                           replica_states=self.watcher.states())
        book = build_book(healthy[0], self.manifest_path)
        warmup = self.warmup_presets()
        used = sorted({layout for report in healthy for layout in report.layouts}, key=str)
        shapes = [self._merge(Layout(p), healthy, book, warmup) for p in self.presets]
        status = replace(
            healthy[0].status,
            busy=all(report.busy for report in healthy),
            queue_depth=self.turns.waiting + self.calls.waiting(),
            visitors_waiting=self.turns.visitors_waiting,
            warmup_queue=self._warmups.pending(),
            warmup_seconds_left=round(sum(s.estimate_seconds or 0.0 for s in shapes if s.warmup_queued), 1),
            shapes=shapes,
            layouts=[self._merge(layout, healthy, book, warmup) for layout in used],
            replicas=replica_rows(reports, self.plan.replicas),
            replica_states=self.watcher.states(),
        )
        self._last = status
        return status

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Up while at least one replica answers; `replicas` is the deployment's count, not every id ever seen."""
        replicas = self.status().replicas or []
        healthy = sum(1 for r in replicas if r["state"] == "healthy")
        return bool(healthy), {"status": "ok" if healthy else "no replica", "replicas_healthy": healthy,
                               "replicas": self.plan.replicas}

    def healthy(self) -> int:
        return len(self.watcher.healthy())


def portable(request: GenerateRequest) -> GenerateRequest:
    """The request with its files read into bytes: a replica on another node cannot open this machine's paths.
    Read as the engine reads them (images/decode.py): regular files only, the size capped while reading."""
    def read(source, role: str):
        return read_file(source, role) if isinstance(source, (str, Path)) else source

    return replace(request, references=tuple(read(r, f"reference {n}") for n, r in enumerate(request.references, 1)),
                   image=None if request.image is None else read(request.image, "image"),
                   mask=None if request.mask is None else read(request.mask, "mask"))
