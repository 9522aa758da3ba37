"""The HTTP server: one FastAPI app under uvicorn, with /healthz and /metrics (Prometheus metrics for the engine, in a
registry of their own) from the first second and the Gradio UI mounted at / (gr.mount_gradio_app) once the model is
loaded.

The server starts before the model loads, so a Space's health check, a load balancer and an operator see the
process come up (503, "loading") instead of a closed port for the minutes a real model takes to load.
No torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from contextlib import AsyncExitStack, asynccontextmanager, nullcontext
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

import gradio as gr
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.routing import Route

from neuron_ui.contract.files import StoredFiles
from neuron_ui.contract.engine_like import LoadingState
from neuron_ui.server.doors import basic_auth_ok
from neuron_ui.server.gate import SHUTTING_DOWN, Admission, Gate
from neuron_ui.web import gradio_bridge, gradio_mount
from neuron_ui.web.files import private_file_folder
from neuron_ui.web.gradio_bridge import device_queue_length
from neuron_ui.web.gradio_mount import GradioLimits, Mounted
from neuron_ui.web.uploads import UploadFolder

if TYPE_CHECKING:
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.contract.errors import ErrorKind
    from neuron_ui.contract.results import CacheEvent, GenerateResult
    from neuron_ui.contract.stopping import SessionStops
    from neuron_ui.server.mcp import McpEndpoint
    from neuron_ui.studio.grid_jobs import GridJobs

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
DRAIN_SECONDS = 30.0  # SIGTERM: how long the image on the device may take to finish before the process exits
MCP_PATHS = ("/gradio_api/mcp", "/gradio_api/mcp/")


class EngineMetrics:
    """An engine observer that counts images, errors, compilations and cache events, and times requests."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.images = Counter("neuron_ui_images", "Images generated", ["resolution", "cache_event"], registry=r)
        self.errors = Counter("neuron_ui_errors", "Requests that failed, by kind", ["kind"], registry=r)
        self.compilations = Counter("neuron_ui_compilations", "Shape compilations, by cache event",
                                    ["resolution", "cache_event"], registry=r)
        self.compile_seconds = Counter("neuron_ui_compile_seconds", "Seconds spent compiling shapes", ["resolution"],
                                       registry=r)
        self.latency = Histogram("neuron_ui_generation_seconds", "Request latency, compilation included",
                                 ["resolution"], buckets=LATENCY_BUCKETS, registry=r)
        self.replica_images = Counter("neuron_ui_replica_images", "Images generated, by engine replica (--replicas)",
                                      ["replica"], registry=r)
        self.queue_depth = Gauge("neuron_ui_queue_depth", "Requests accepted and waiting for the device", registry=r)
        self.busy = Gauge("neuron_ui_device_busy", "1 while a request or a warm-up runs on the device", registry=r)
        self.loaded = Gauge("neuron_ui_model_loaded", "1 once the model is loaded and the UI served", registry=r)
        self.persistent = Gauge("neuron_ui_cache_persistent",
                                "1 when compiled shapes survive a restart; 0 when the cache folder is unusable",
                                registry=r)
        self.held = Gauge("neuron_ui_gradio_held", "Records Gradio holds per session or event, each bounded "
                          "(docs/operations.md#memory)", ["record"], registry=r)

    def attach(self, engine: EngineLike, waiting: Callable[[], int], held: Callable[[], dict[str, int]]) -> None:
        """Observe `engine`; `waiting` counts requests not yet on the device, `held()` what Gradio holds, served as
        neuron_ui_gradio_held{record=...}; the gauges read them, and the engine's status, at each scrape (0 before)."""
        self.queue_depth.set_function(waiting)
        self.busy.set_function(lambda: engine.status().busy)
        self.persistent.set_function(lambda: engine.status().persistent_cache)
        engine.observers.add(self)
        self.loaded.set(1)
        for record in held():
            self.held.labels(record).set_function(functools.partial(lambda name: held()[name], record))

    def on_generated(self, result: GenerateResult) -> None:
        self.images.labels(result.resolution, result.cache_event).inc()
        self.latency.labels(result.resolution).observe(result.total_seconds)
        if result.replica:
            self.replica_images.labels(result.replica).inc()

    def on_compiled(self, resolution: str, event: CacheEvent, seconds: float) -> None:
        self.compilations.labels(resolution, event).inc()
        self.compile_seconds.labels(resolution).inc(seconds)

    def on_failed(self, kind: ErrorKind) -> None:
        self.errors.labels(kind).inc()


class Server:
    """uvicorn in a thread serving `app`: start() binds the port, mount() adds the UI, stop() ends it all.

    `gradio_limits` bounds what Gradio keeps per session (the tests give small ones)."""

    def __init__(self, settings: Settings, health: Callable[[], str | None] | None = None,
                 loading: LoadingState | None = None, gradio_limits: GradioLimits | None = None):
        self.settings = settings
        self.health = health  # why serving is impaired (None: it is not), e.g. a tensor-parallel rank is gone
        self.loading = loading or LoadingState()  # what start-up does before serving (a compile-cache download)
        self.metrics = EngineMetrics()
        self.gradio_limits = gradio_limits or GradioLimits()
        self.mounted: Mounted | None = None  # the UI, once mount() serves it
        self.engine: EngineLike | None = None
        self.grids: GridJobs[Any] | None = None  # the page's grid jobs, once mounted: the drain waits for their sheets
        self.share_url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        folder = private_file_folder()
        # the only files a request may name: uploads and results; their folder is never sent out (asgi.Outbound)
        self.stored = StoredFiles(folder)
        self.uploads = UploadFolder(folder, settings.upload_budget_mb * 2**20, settings.upload_retention)
        self.draining = False
        # the device's one bound over every door: Gradio's events (once mounted) and MCP's calls
        self.admission = Admission(settings.max_queue,
                                   lambda: device_queue_length(self.mounted.demo, running=True) if self.mounted else 0)
        self.drain_requested = threading.Event()  # set() it (safe in a signal handler): serve_forever() drains
        self._gradio_lifespan = AsyncExitStack()
        self._thread: threading.Thread | None = None
        self.mcp: McpEndpoint | None = None
        if settings.mcp:
            from neuron_ui.server.mcp import McpEndpoint  # only with --mcp: the `mcp` package

            self.mcp = McpEndpoint(settings, self.admission)
        self.app = self._build_app()
        config = uvicorn.Config(self.app, host=settings.host, port=settings.port, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=3)
        self._uvicorn = uvicorn.Server(config)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.settings.host in ("0.0.0.0", "") else self.settings.host
        return f"http://{host}:{self.settings.port}"

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI):
            self._loop = asyncio.get_running_loop()
            # Gradio's own lifespan, entered by mount(), ends with ours; the MCP sessions' too (--mcp)
            async with self._gradio_lifespan, self.mcp.manager.run() if self.mcp else nullcontext():
                yield

        app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(Gate, server=self)

        @app.api_route("/healthz", methods=["GET", "HEAD"])
        async def healthz() -> JSONResponse:  # async: never waits for a thread behind a burst of requests
            """200 once the model is loaded and the UI is served; 503 before, and once shutting down."""
            if self.draining:
                return JSONResponse({"status": "shutting down"}, status_code=503)
            if self.mounted is None or self.engine is None:
                return JSONResponse(self.loading.body(), status_code=503, headers={"Retry-After": "5"})
            if problem := self.health and self.health():
                return JSONResponse({"status": problem}, status_code=503, headers={"Retry-After": "5"})
            up, body = self.engine.health()
            return JSONResponse(body, status_code=200 if up else 503)

        @app.api_route("/metrics", methods=["GET", "HEAD"])
        def metrics(request: Request) -> Response:
            """Prometheus text format; behind the same user and password as the UI when NEURON_UI_AUTH is set."""
            auth = self.settings.auth
            if auth and not basic_auth_ok(request.headers.get("authorization"), auth):
                return Response("authentication required\n", status_code=401,
                                headers={"WWW-Authenticate": 'Basic realm="neuron-ui metrics"'})
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        if self.mcp is not None:  # before Gradio's mount at /, which would answer these paths itself
            app.router.routes.extend(Route(path, endpoint=self.mcp) for path in MCP_PATHS)
        return app

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> Server:
        """Bind the port and serve /healthz (503) and /metrics while the caller loads the model."""
        self._thread = threading.Thread(target=self._run, name="http-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive():
                raise OSError(f"cannot serve on {self.settings.host}:{self.settings.port}: is the port in use?")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP server did not start within {timeout:.0f} s")
            time.sleep(0.01)
        logger.info("listening on %s: /healthz and /metrics now, the UI once the model is loaded", self.url)
        return self

    def _run(self) -> None:
        with contextlib.suppress(SystemExit):  # uvicorn logs why (e.g. the port is taken) and exits; start() reports it
            self._uvicorn.run()

    def mount(self, engine: EngineLike, demo: gr.Blocks, stops: SessionStops, grids: GridJobs[Any],
              timeout: float = 30.0) -> Server:
        """Serve the queued demo at / and start its queue; /healthz turns 200. `stops` is the demo's registry of
        running requests by session (its builder's), which a client's cancel or disconnect stops (the gate); `grids`
        its grid jobs (its studio's), which outlive their pages and which the drain waits for."""
        if self._loop is None:
            raise RuntimeError("start() the server before mounting the UI")
        if calls := gradio_bridge.page_server_calls(demo):  # the gate refuses them (server/doors.py)
            raise RuntimeError(f"{', '.join(calls)} would call /gradio_api/component_server, which this app refuses")
        mounted = gradio_mount.mount(self.app, demo, stops, self.settings, self.gradio_limits, self.uploads,
                                     self._gradio_lifespan, self._loop, timeout)
        # everything accepted and not yet on the device: Gradio's queue, then the engine's own (behind a warm-up)
        self.metrics.attach(engine, waiting=lambda: device_queue_length(demo) + engine.status().queue_depth,
                            held=mounted.held)
        if self.mcp is not None:  # before the gate lets requests through (it answers "loading" until `mounted`)
            logger.info("MCP tools at %s/gradio_api/mcp/ (%s)", self.url, ", ".join(self.mcp.serve(engine)))
        self.engine, self.grids, self.mounted = engine, grids, mounted
        logger.info("serving the UI at %s%s", self.url, " (login required)" if self.settings.auth else "")
        if self.settings.share:
            self.share_url = mounted.open_share_link(self.settings)
        return self

    def serve_forever(self) -> bool:
        """Block until the server stops, or drains once drain_requested is set (main.stop_on_signals sets it on
        SIGTERM and Ctrl-C). False when a drain ran out of time with the device still busy (see drain())."""
        # the drain's event wakes this at once (a signal handler sets it); the thread's end within 0.5 s
        while self._thread is not None and self._thread.is_alive() and not self.drain_requested.wait(0.5):
            pass
        return self.drain() if self.drain_requested.is_set() else True

    def drain(self, timeout: float = DRAIN_SECONDS) -> bool:
        """A graceful stop: new requests get 503 "shutting down" (and /healthz 503, so a balancer stops sending),
        the image on the device may finish within `timeout`, every waiting request is told the server is shutting
        down, and every grid being made ends with the sheet of its cells made (saved within `timeout` too); True if
        the device was idle in time. The caller then stop()s."""
        self.draining = True  # from here nothing new reaches the device: what is there now is all there is to wait for
        # idle: nothing on the device nor waiting for it, in Gradio's queue, the engine's, or MCP's, and no grid between
        # two of its cells (a page's grid outlives its page: studio/grid_jobs.py)
        status = self.engine.status() if self.engine is not None else None
        making = self.grids.running() if self.grids is not None else 0
        if self.admission.count() == 0 and not making and (status is None or not (status.busy or status.queue_depth)):
            logger.info("shutting down: nothing is running or waiting")
            return self.engine.drain(0) if self.engine is not None else True
        logger.info("shutting down: no new requests; the image on the device has up to %.0f s to finish", timeout)
        deadline = time.monotonic() + timeout
        finished = self.engine.drain(timeout) if self.engine is not None else True
        # The engine now refuses every grid's next cell: each ends as a Stop ends it, its sheet saved in its own
        # thread, which the process's exit would cut short.
        if self.grids is not None and not self.grids.wait(max(deadline - time.monotonic(), 0.0)):
            logger.warning("a grid's sheet of the cells made was not saved within %.0f s", timeout)
        # Gradio starts what waited in its queue one by one; each is refused by the closed device at once.
        while self.mounted and device_queue_length(self.mounted.demo) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the last answers reach their event streams
        if not finished and self.mounted is not None and self._loop is not None:
            # the requests Gradio still holds hear "shutting down" and their streams close
            ended = asyncio.run_coroutine_threadsafe(self.mounted.end_events(SHUTTING_DOWN), self._loop).result(10)
            logger.error("the image on the device did not finish within %.0f s; stopping anyway (%d request%s told "
                         "the server is shutting down)", timeout, ended, "" if ended == 1 else "s")
        return finished

    def stop(self, timeout: float = 10.0) -> None:
        if self.mounted is not None:
            self.mounted.stop(self._loop)
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
