"""The seam: the one engine interface the UI and the server use, the observers an engine tells, and what /healthz says
while the process loads (LoadingState) and once it serves (Health)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from neuron_ui.config.resolutions import Resolution
    from neuron_ui.contract.errors import ErrorKind
    from neuron_ui.contract.layouts import Layout
    from neuron_ui.contract.requests import GenerateRequest
    from neuron_ui.contract.results import CacheEvent, EngineStatus, GenerateResult, ProgressFn, ShapeStatus
    from neuron_ui.contract.stopping import StopToken

logger = logging.getLogger(__name__)

Health = tuple[bool, dict[str, object]]  # /healthz once serving: up?, and the JSON body to send


class LoadingState:
    """What the process does before it serves (fetching a compile cache, ...), for /healthz's loading answer: one
    phase with its byte counts; the start-up thread writes it, the HTTP server's /healthz reads it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._phase: dict = {}

    def set(self, phase: str, done_bytes: int | None = None, total_bytes: int | None = None) -> None:
        with self._lock:
            self._phase = {"phase": phase, "done_bytes": done_bytes, "total_bytes": total_bytes}

    def clear(self) -> None:
        with self._lock:
            self._phase = {}

    def body(self) -> dict:
        """`{"status": "loading"}`, with `phase`, `done_bytes` and `total_bytes` (null when unknown) during a phase."""
        with self._lock:
            return {"status": "loading", **self._phase}


class EngineObserver(Protocol):
    """Told what the engine did, e.g. to count it for /metrics; the engine itself knows nothing of metrics."""

    def on_generated(self, result: GenerateResult) -> None: ...

    def on_compiled(self, resolution: str, event: CacheEvent, seconds: float) -> None: ...

    def on_failed(self, kind: ErrorKind) -> None: ...


class Observers:
    """An engine's observers, told in turn through one typed method per event; an observer's bug never fails a
    user's request."""

    def __init__(self) -> None:
        self._observers: list[EngineObserver] = []

    def add(self, observer: EngineObserver) -> None:
        self._observers.append(observer)

    def generated(self, result: GenerateResult) -> None:
        self._tell("on_generated", lambda observer: observer.on_generated(result))

    def compiled(self, resolution: str, event: CacheEvent, seconds: float) -> None:
        self._tell("on_compiled", lambda observer: observer.on_compiled(resolution, event, seconds))

    def failed(self, kind: ErrorKind) -> None:
        self._tell("on_failed", lambda observer: observer.on_failed(kind))

    def _tell(self, what: str, call: Callable[[EngineObserver], None]) -> None:
        for observer in self._observers:
            try:
                call(observer)
            except Exception:
                logger.exception("observer %r failed in %s", observer, what)


class EngineLike(Protocol):
    """The one seam between the UI (and the server) and whatever makes images: neuron_ui.engine.engine.Engine, the
    one front over a runner on this process's device (rank 0's under torchrun) or on Ray Serve replicas.
    Errors: ValueError for bad input, EngineError (one line, safe to show) for failures."""

    presets: tuple[Resolution, ...]
    max_references: int
    reference_sizes: tuple[Resolution, ...]
    observers: Observers

    def generate(self, request: GenerateRequest, progress: ProgressFn | None = None,
                 stop: StopToken | None = None) -> GenerateResult: ...
    def inpaint(self, request: GenerateRequest, progress: ProgressFn | None = None,
                stop: StopToken | None = None) -> GenerateResult: ...
    def warmup(self, resolution: str, progress: ProgressFn | None = None, *,
               visitor: str | None = None) -> ShapeStatus: ...
    def prompt_tokens(self, text: str) -> tuple[int, int]: ...
    def start_warmup(self, resolutions: list[str]) -> None: ...
    def layout(self, resolution: str, references: int = 0, reference_size: str | None = None,
               inpaint: bool = False) -> Layout: ...
    def layout_status(self, layout: Layout) -> ShapeStatus: ...
    def status(self) -> EngineStatus: ...
    def health(self) -> Health: ...
    # Shutting down (the server's drain): new requests refused, the waiting told so, True if the device emptied in
    # time; what serving holds besides the engine is neuron_ui.serving's lifecycle (Loaded: start, stop).
    def drain(self, timeout: float) -> bool: ...
