"""ReplicaRunner: the engine front's runner (engine.engine.DeviceRunner) whose images are made by a Ray Serve
deployment of engine replicas. The front (engine.engine.Engine, the same as in one process) gives it as many requests
at once as there are replicas; it sends each as a stream routed by its layout (neuron_ui.replicas.stream), retried once
where its replica dies, and reads the replicas' reports (neuron_ui.replicas.board): its graph book takes what their
books hold, for each size's state over all of them, beside a row per replica, so the status and /healthz never wait
for Ray.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.contract import references as refs
from neuron_ui.contract.engine_like import Health, Observers
from neuron_ui.contract.errors import EngineError, ErrorKind
from neuron_ui.images.decode import read_file
from neuron_ui.contract.layouts import Layout, Layouts
from neuron_ui.contract.requests import count_prompt_tokens
from neuron_ui.contract.results import GenerateResult
from neuron_ui.engine.graphs import GraphBook
from neuron_ui.replicas.board import (APP_NAME, REPORT_SECONDS, STALE_SECONDS, ReplicaReport, ReplicaWatcher, Reports,
                                      replica_rows)
from neuron_ui.replicas.stream import ShapeRouting, StreamCaller

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from ray.serve.handle import DeploymentHandle

    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.requests import GenerateRequest
    from neuron_ui.contract.results import EngineStatus, ProgressFn, ShapeStatus
    from neuron_ui.contract.stopping import StopToken
    from neuron_ui.engine.waiting import DeviceWatch
    from neuron_ui.replicas.plan import ReplicaPlan


class ReplicaRunner:
    """Images made by replicas, one at a time each: a slot per replica at the front; a retry has the same seed."""

    def __init__(self, handle: DeploymentHandle, board: ActorHandle, settings: Settings, plan: ReplicaPlan,
                 app_name: str = APP_NAME, watcher: ReplicaWatcher | None = None,
                 clock: Callable[[], float] = time.perf_counter, grpc: bool = False):
        """`watcher` reads the replicas' reports (by default the board's and Serve's, on Ray); `clock` measures the
        time a request lost on a replica that died; `grpc`: calls over Serve's gRPC (neuron_ui.replicas.stream)."""
        self.board = board
        self.plan = plan
        self.slots = plan.replicas  # each replica makes one image at a time
        self.allowed = Layouts(settings.resolutions, refs.REFERENCE_SIZES, settings.max_references)
        self.manifest_path = Path(settings.cache_dir).expanduser().resolve() / "manifest.json"
        self.observers = Observers()
        self.calls = StreamCaller(handle, self.observers, clock, ShapeRouting(plan.replicas), grpc)
        self.close = self.calls.close  # shutting down: every call still waiting in Serve's router hears so
        self._last: EngineStatus | None = None
        self._book: tuple[float, GraphBook] | None = None  # when read, and the book of the shared manifest
        self._tokenizer: object = None
        self.watcher = watcher or ReplicaWatcher.on_ray(board, app_name)
        self.stop = self.watcher.stop  # after the drain, before Ray stops: no more reads of the board
        self.startup: dict[str, float] = {}  # seconds per stage of the launch (neuron_ui.replicas.launch)

    def prepare(self, request: GenerateRequest, layout: Layout) -> GenerateRequest:
        """The request as a replica gets it: its files read into bytes, and a fixed seed, so a retry makes the same
        image; the replica's engine checks the rest."""
        request = portable(request)
        return request if request.seed is not None else replace(request, seed=secrets.randbelow(2**32))

    def make(self, job: GenerateRequest, layout: Layout, report: ProgressFn, stop: StopToken,
             watch: DeviceWatch) -> GenerateResult:
        """One image on the replica that holds its graph; `stop` cancels the request's stream, which stops it on its
        replica at the next step (Stopped here)."""
        watch.running(layout, time.perf_counter())
        try:
            result = self.calls.call("generate", job, layout, report, stop)
        finally:
            watch.idle()
        assert isinstance(result, GenerateResult), result  # generate's Done carries one
        watch.ran(layout, result.run_seconds)
        return result

    def warm(self, layout: Layout, report: ProgressFn, watch: DeviceWatch) -> None:
        """Compile one layout on one replica; the others load it from the cache when asked for it."""
        self.calls.call("warmup", str(layout), layout, report)

    def prompt_tokens(self, text: str) -> tuple[int, int]:
        """Counted here, with the tokenizer a replica shared once (a call to a replica would wait behind images)."""
        if self._tokenizer is None:
            self._tokenizer = ray.get(self.board.tokenizer.remote(), timeout=10)
        if self._tokenizer is None:
            raise EngineError("no replica has shared its tokenizer yet", kind=ErrorKind.NO_REPLICA)
        return count_prompt_tokens(self._tokenizer, text)

    def reports(self) -> Reports:
        """Each replica's last report and its age in seconds, as the watcher last read them; busy also where a call
        of this front runs on it now (a replica reports busy at its next tick, not as the image starts)."""
        running = set(self.calls.routing.running())
        return {key: (age, replace(report, busy=True) if report.replica in running else report)
                for key, (age, report) in self.watcher.reports().items()}

    def book(self, healthy: list[ReplicaReport]) -> GraphBook:
        """The front's graph book: what the healthy replicas' books hold, and estimates for what none holds from the
        shared manifest as it was on disk at most a report ago."""
        if healthy and (self._book is None or time.monotonic() - self._book[0] > REPORT_SECONDS):
            # the shared manifest as it is on disk now
            self._book = (time.monotonic(), GraphBook(healthy[0].key, CacheManifest(self.manifest_path)))
        if self._book is None:
            raise EngineError("no replica has reported yet", kind=ErrorKind.NO_REPLICA)
        self._book[1].take([report.graphs for report in healthy])
        return self._book[1]

    def compile_left(self, layout: Layout) -> float | None:
        healthy = self.watcher.healthy()
        return self.book(healthy).compile_left(layout) if healthy else None

    def shape(self, layout: Layout, warmup: list[Layout]) -> ShapeStatus:
        """One layout over the healthy replicas, as the front's book holds it: ready on k of N."""
        healthy = self.watcher.healthy()
        book = self.book(healthy)
        ready_on = sum(book.compile_mode == "eager" or layout.tokens in r.graphs.ready() for r in healthy)
        return replace(book.status(layout, warmup), ready_on=ready_on, replicas_total=self.plan.replicas)

    def used(self) -> list[Layout]:
        return sorted(self.book(self.watcher.healthy()).used(), key=str)

    def status(self) -> EngineStatus:
        """A replica's status (the last heard) with a row per replica and Serve's count per replica state."""
        reports = self.reports()
        healthy = [report for age, report in reports.values() if age < STALE_SECONDS]
        if healthy:
            self._last = healthy[0].status
        if self._last is None:
            raise EngineError("no replica has reported yet", kind=ErrorKind.NO_REPLICA)
        return replace(self._last, replicas=replica_rows(reports, self.plan.replicas),
                       replica_states=self.watcher.states())

    def health(self) -> Health:
        """Up while at least one replica answers; `replicas` is the deployment's count, not every id ever seen."""
        healthy = len(self.watcher.healthy())  # each fresh report is a healthy row (replica_rows)
        return bool(healthy), {"status": "ok" if healthy else "no replica", "replicas_healthy": healthy,
                               "replicas": self.plan.replicas}


def portable(request: GenerateRequest) -> GenerateRequest:
    """The request with its files read into bytes: a replica on another node cannot open this machine's paths.
    Read as the engine reads them (contract/images.py): regular files only, the size capped while reading."""
    def read(source, role: str):
        return read_file(source, role) if isinstance(source, (str, Path)) else source

    return replace(request, references=tuple(read(r, f"reference {n}") for n, r in enumerate(request.references, 1)),
                   image=None if request.image is None else read(request.image, "image"),
                   mask=None if request.mask is None else read(request.mask, "mask"))
