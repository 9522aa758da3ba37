"""Engine replicas on Ray Serve, routed by shape: one engine per replica, one client with the engine's methods.

    python app.py --replicas 2                    # a local Ray bound to loopback, 2 replicas
    ray start --head && python app.py --ray-address auto --replicas 4

Routing: Ray Serve model multiplexing, the model id being the request's token count (presets with one count share
one graph). A replica that holds a graph attracts its requests; a request whose holders are all busy (each runs
max_ongoing_requests = 1 request: one image at a time) goes, after one back-off, to the replicas holding the
fewest graphs, which load it from the shared cache. Multiplexing chosen over a custom RequestRouter (alpha in 2.60):
no routing code of ours, and the one thing it lacks, compiling a shape once in the whole deployment, is a file lock
per (compile key, token count) in the shared cache folder: the first replica to take it compiles; any other waits on
it and then loads the graph from the cache (disk_hit). The kernel drops a lock whose holder dies (kill -9), so a
waiter never waits for a dead replica.

Imports Ray: app.py imports this module only when --replicas or --ray-address is given.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.serve.exceptions import RequestCancelledError

from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.contract import references as refs
from neuron_ui.contract.engine_like import Observers
from neuron_ui.contract.errors import EngineError
from neuron_ui.contract.layouts import Layout, Layouts
from neuron_ui.contract.requests import count_prompt_tokens
from neuron_ui.contract.results import ProgressUpdate
from neuron_ui.contract.stopping import COMPILING as COMPILING_NOW
from neuron_ui.contract.stopping import QUEUED, RUNNING, Stopped, StopToken
from neuron_ui.engine.graphs import GraphBook
from neuron_ui.engine.warmup import WarmupList
from neuron_ui.replicas.board import APP_NAME, REPORT_SECONDS, STALE_SECONDS
from neuron_ui.replicas.status import merge_shape, replica_row

if TYPE_CHECKING:
    from neuron_ui.config.resolutions import Resolution
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.requests import GenerateRequest
    from neuron_ui.contract.results import EngineStatus, GenerateResult, ProgressFn, ShapeStatus
    from neuron_ui.replicas.plan import ReplicaPlan

logger = logging.getLogger(__name__)

STATES_SECONDS = 1.0  # how often the front asks Serve's controller for its replica states
REPLICA_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


# What a stopped request answers, by where it was when the front cancelled its stream (stopping's phases).
STOPPED_WORDS = {
    QUEUED: "stopped: you left the queue; no image was made",
    COMPILING_NOW: "stopped: {layout} keeps compiling and will be ready; your image was not made",
    RUNNING: "stopped at the next step; no image was made",
}


class ReplicaClient:
    """What the UI and the server use of an Engine (neuron_ui.ui.EngineLike), served by replicas.

    Errors are the engine's: ValueError for bad input, EngineError (one line) for failures. A request whose
    replica dies is sent once more, with the same seed, to another replica. A watcher thread reads the replicas'
    reports, so status() and /healthz never wait for Ray."""

    def __init__(self, handle, board, settings: Settings, plan: ReplicaPlan, app_name: str = APP_NAME):
        self.handle = handle
        self.board = board
        self.plan = plan
        self.app_name = app_name
        self.presets = settings.resolutions
        self.max_references = settings.max_references
        self.reference_sizes = refs.REFERENCE_SIZES
        self.allowed = Layouts(self.presets, self.reference_sizes, self.max_references)
        self.manifest_path = Path(settings.cache_dir).expanduser().resolve() / "manifest.json"
        self.observers = Observers()
        self._lock = threading.Lock()
        self._waiting = 0  # sent to the deployment, not yet started on a replica
        self._closed = False
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}
        self._replica_states: dict[str, int] = {}  # Serve's count per replica state (RUNNING, STARTING, ...)
        self._states_read = -STATES_SECONDS  # when they were last read (time.monotonic())
        self._last: EngineStatus | None = None
        self._tokenizer: Any = None
        self._warmups: WarmupList[str] = WarmupList(self._warm_one)
        self._watch_once()
        self._watcher = threading.Thread(target=self._watch, name="replica-watch", daemon=True)
        self._watcher.start()

    # -- requests ----------------------------------------------------------------------------------------

    def layout(self, resolution: str, references: int = 0, reference_size: str | None = None,
               inpaint: bool = False) -> Layout:
        return self.allowed.layout(resolution, references, reference_size, inpaint)

    def generate(self, request: GenerateRequest, progress: ProgressFn | None = None,
                 stop: StopToken | None = None) -> GenerateResult:
        """One image on the replica that holds its graph; a fixed seed, so a retry makes the same image.
        `stop` cancels the request's stream, which stops it on its replica at the next step (Stopped here)."""
        try:
            layout = self.layout(request.resolution, len(request.references), request.reference_size,
                                 inpaint=request.image is not None or request.mask is not None)
            request = portable(request)
        except ValueError:
            self.observers.notify("on_failed", "invalid_request")
            raise
        if request.seed is None:
            request = replace(request, seed=secrets.randbelow(2**32))
        result = self._call("generate", request, layout, progress, stop)
        self.observers.notify("on_generated", result)
        return result

    def prompt_tokens(self, text: str) -> tuple[int, int]:
        """Counted here, with the tokenizer a replica shared once (a call to a replica would wait behind images)."""
        if self._tokenizer is None:
            self._tokenizer = ray.get(self.board.tokenizer.remote(), timeout=10)
        if self._tokenizer is None:
            raise EngineError("no replica has shared its tokenizer yet", kind="no_replica")
        return count_prompt_tokens(self._tokenizer, text)

    def inpaint(self, request: GenerateRequest, progress: ProgressFn | None = None,
                stop: StopToken | None = None) -> GenerateResult:
        """Redo the masked part of `request.image`; a request without image and mask is refused."""
        if request.image is None or request.mask is None:
            self.observers.notify("on_failed", "invalid_request")
            raise ValueError("inpainting needs both an image and a mask")
        return self.generate(request, progress, stop)

    def warmup(self, resolution: str, progress: ProgressFn | None = None) -> ShapeStatus:
        """Compile one preset on one replica; the others load it from the cache when asked for it."""
        layout = self.layout(resolution)
        self._call("warmup", str(layout), layout, progress)
        return self.layout_status(layout)

    def start_warmup(self, resolutions: list[str]) -> None:
        """Warm these presets up one after another in the background, each compiled once in the deployment."""
        self._warmups.add([str(self.layout(r)) for r in resolutions])

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        return self._warmups.wait(timeout)

    def drain(self, timeout: float) -> bool:
        """Shutting down: no new requests from this front; True once none it sent is still running."""
        self._closed = True
        deadline = time.monotonic() + timeout
        while self._busy_replicas() and time.monotonic() < deadline:
            time.sleep(0.2)
        return not self._busy_replicas()

    def _busy_replicas(self) -> int:
        with self._lock:
            return sum(1 for age, snap in self._reports.values() if age < STALE_SECONDS and snap["busy"])

    def _warm_one(self, resolution: str) -> bool:
        if self._closed:
            return False
        try:
            self.warmup(resolution)
        except (ValueError, EngineError) as error:
            logger.warning("warm-up of %s failed: %s", resolution, error)
        return True

    def _call(self, method: str, argument: Any, layout: Layout, progress: ProgressFn | None,
              stop: StopToken | None = None) -> Any:
        if self._closed:
            raise EngineError("the server is shutting down; try again in a minute", kind="shutting_down")
        report = progress or (lambda update: None)
        for attempt in (1, 2):
            try:
                return self._stream(method, argument, layout, report, stop or StopToken())
            except REPLICA_LOST as error:
                if attempt == 2:
                    self.observers.notify("on_failed", "replica_lost")
                    raise EngineError("the replica making this image stopped twice; try again in a minute",
                                      kind="replica_lost") from error
                logger.warning("a replica stopped during %s at %s (%s); retrying once", method, layout,
                               type(error).__name__)
                report(ProgressUpdate("waiting", "a replica stopped; trying again on another"))

    def _stream(self, method: str, argument: Any, layout: Layout, report: ProgressFn, stop: StopToken) -> Any:
        with self._lock:
            ahead = self._waiting
            self._waiting += 1
        waiting = True
        if ahead:
            report(ProgressUpdate("waiting", f"waiting for a free replica, {ahead} ahead"))
        try:
            handle = self.handle.options(stream=True, multiplexed_model_id=str(layout.tokens))
            done = []
            stream = getattr(handle, method).remote(argument)
            forget = stop.listen(stream.cancel)
            if stop.stopped:  # stopped before the stream existed
                stream.cancel()
            try:
                # Read to the end of the stream, not just to "done": the replica counts as busy until its request
                # ends, and the next request for this graph should find it free, not spill to another replica.
                for item in stream:
                    self._take(item, report, stop, done, waiting)
                    waiting = waiting and item[0] != "started"
            except RequestCancelledError:
                self.observers.notify("on_failed", "stopped")
                raise Stopped(STOPPED_WORDS.get(stop.phase, STOPPED_WORDS[QUEUED]).format(layout=layout)) from None
            finally:
                forget()
            if done:
                return done[0]
            raise EngineError(f"the replica ended {method} without a result", kind="replica_lost")
        finally:
            if waiting:
                with self._lock:
                    self._waiting -= 1

    def _take(self, item: tuple, report: ProgressFn, stop: StopToken, done: list, waiting: bool) -> None:
        """One item of a replica's stream (EngineReplica._serve says what each is)."""
        kind, *payload = item
        if kind == "started" and waiting:
            with self._lock:
                self._waiting -= 1
        elif kind == "progress":
            report(payload[0])
        elif kind == "phase":
            stop.enter(payload[0])
        elif kind == "compiled":
            self.observers.notify("on_compiled", *payload)
        elif kind == "error":
            error_kind, message = payload
            self.observers.notify("on_failed", error_kind)
            if error_kind == "invalid_request":
                raise ValueError(message)
            raise (Stopped(message) if error_kind == "stopped" else EngineError(message, kind=error_kind))
        elif kind == "done":
            done.append(payload[0])

    def _watch(self) -> None:
        # Ends with Ray: a Ray call after ray.shutdown() would start a new local Ray (Ray's auto-init).
        while not self._closed and ray.is_initialized():
            time.sleep(REPORT_SECONDS / 2)
            self._watch_once()

    def _watch_once(self) -> None:
        """Read the board and Serve's replica states; a failed read keeps the last (its ages then grow)."""
        if not ray.is_initialized():
            return
        try:
            reports = ray.get(self.board.read.remote(), timeout=10)
            states = None
            if time.monotonic() - self._states_read > STATES_SECONDS:  # the controller is asked less often
                deployment = serve.status().applications[self.app_name].deployments["engine"]
                states = {str(getattr(k, "value", k)): v for k, v in deployment.replica_states.items()}
                self._states_read = time.monotonic()
        except Exception as error:  # noqa: BLE001 - Ray busy or shutting down: the status says so by its ages
            logger.debug("cannot read the replicas' reports: %s", error)
            return
        with self._lock:
            self._reports = reports
            if states is not None:
                self._replica_states = states

    def reports(self) -> dict[str, tuple[float, dict[str, Any]]]:
        """Each replica's last report and its age in seconds, as the watcher last read them."""
        with self._lock:
            return dict(self._reports)

    def wait_for_replicas(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while sum(age < STALE_SECONDS for age, _ in self.reports().values()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} replicas reported within {timeout:.0f} s")
            time.sleep(0.2)
            self._watch_once()

    def _book(self, snapshot: dict[str, Any]) -> GraphBook:
        """Estimates for what no replica holds, from the shared manifest as it is on disk now."""
        status: EngineStatus = snapshot["status"]
        return GraphBook(snapshot["key"], CacheManifest(self.manifest_path), status.compile_mode,
                         status.compile_backend)

    def layout_status(self, layout: Layout) -> ShapeStatus:
        """One layout over all healthy replicas, e.g. for the line under the editing form before the click."""
        healthy = self._healthy()
        if not healthy:
            raise EngineError("no replica is answering; try again in a minute", kind="no_replica")
        return self._merge(layout, healthy, self._book(healthy[0]), self.warmup_presets())

    def warmup_presets(self) -> list[Resolution]:
        return [self.allowed.layout(r).resolution for r in self._warmups.pending()]

    def _healthy(self) -> list[dict[str, Any]]:
        return [snap for age, snap in self.reports().values() if age < STALE_SECONDS]

    def _merge(self, layout: Layout, healthy: list[dict[str, Any]], book: GraphBook,
               warmup: list[Resolution]) -> ShapeStatus:
        seen = [row for snap in healthy for row in snap["status"].shapes + snap["status"].layouts
                if row.tokens == layout.tokens and row.layout == (None if layout.plain else str(layout))]
        if book.compile_mode == "eager":  # nothing to compile: ready wherever a replica answers
            ready_on = len(healthy)
        else:
            ready_on = sum(layout.tokens in snap["graphs"] for snap in healthy)
        return merge_shape(book.status(layout, warmup), seen, ready_on, self.plan.replicas)

    def status(self) -> EngineStatus:
        """One status over all replicas: each size ready on k of N, and a section per replica."""
        reports = self.reports()
        healthy = [snap for age, snap in reports.values() if age < STALE_SECONDS]
        if not healthy:
            if self._last is None:
                raise EngineError("no replica has reported yet", kind="no_replica")
            rows = [replica_row(snap, age) for age, snap in sorted(reports.values(), key=lambda r: r[1]["replica"])]
            return replace(self._last, busy=False, replicas=rows, replica_states=self._states())
        book = self._book(healthy[0])
        warmup = self.warmup_presets()
        used = sorted({layout for snap in healthy for layout in snap["layouts"]}, key=str)
        shapes = [self._merge(Layout(p), healthy, book, warmup) for p in self.presets]
        with self._lock:
            waiting = self._waiting
        warmup_names = self._warmups.pending()
        rows = [replica_row(snap, age) for age, snap in sorted(reports.values(), key=lambda r: r[1]["replica"])]
        status = replace(
            healthy[0]["status"],
            busy=all(s["busy"] for s in healthy),
            queue_depth=waiting,
            warmup_queue=warmup_names,
            warmup_seconds_left=round(sum(s.estimate_seconds or 0.0 for s in shapes if s.warmup_queued), 1),
            shapes=shapes,
            layouts=[self._merge(layout, healthy, book, warmup) for layout in used],
            replicas=rows,
            replica_states=self._states(),
        )
        self._last = status
        return status

    def _states(self) -> dict[str, int]:
        with self._lock:
            return dict(self._replica_states)

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Up while at least one replica answers."""
        replicas = self.status().replicas or []
        healthy = sum(1 for r in replicas if r["state"] == "healthy")
        return bool(healthy), {"status": "ok" if healthy else "no replica", "replicas_healthy": healthy,
                               "replicas": len(replicas)}

    def healthy(self) -> int:
        return len(self._healthy())


def portable(request: GenerateRequest) -> GenerateRequest:
    """The request with its files read into bytes: a replica on another node cannot open this machine's paths."""
    def read(source):
        if isinstance(source, (str, Path)):
            try:
                return Path(source).read_bytes()
            except OSError as error:
                raise ValueError(f"cannot read the uploaded file: {error.strerror or error}") from error
        return source

    return replace(request, references=tuple(read(r) for r in request.references),
                   image=None if request.image is None else read(request.image),
                   mask=None if request.mask is None else read(request.mask))
