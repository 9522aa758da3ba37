"""Helpers for tests that serve app.py's app in this process: a free local port, the server, clients, waits.

Not a test module; test_reliability.py and test_load.py import it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import torch
from gradio_client import Client

from runners import RunnerWrapper
from waiting import wait_until  # noqa: F401 (the tests' one wait, re-exported)

from neuron_ui.config.processes import free_port
from neuron_ui.contract.stopping import SessionStops
from neuron_ui.web.gradio_mount import GradioLimits
from neuron_ui.main import build_app, parse_settings
from neuron_ui.server.server import Server
from neuron_ui.serving import build_engine
from neuron_ui.ui.handlers import Handlers

TIMEOUT = 120  # seconds for any one call; nothing here should take a tenth of that


@dataclass
class Served:
    engine: Any
    demo: Any
    server: Any  # neuron_ui.server.Server
    settings: Any
    stops: SessionStops  # the UI's running requests by session, handed to the server too
    ui: Handlers  # the UI's Handlers, as build_app handed them back
    runner: Any = None  # the wrapper served(wrap_runner=...) built around the engine's runner

    @property
    def url(self) -> str:
        return self.server.url

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url + path, timeout=TIMEOUT, **kwargs)

    def handlers(self) -> Handlers:
        """The UI's Handlers (the ones behind the /generate endpoint): their image store, status and tick."""
        return self.ui

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample from /metrics, parsed as Prometheus text; None when absent."""
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(self.get("/metrics", auth=self.metrics_auth).text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None

    @property
    def metrics_auth(self):
        return self.settings.auth


@contextmanager
def served(cache_dir, *flags: str, environ: dict | None = None,
           engine: Callable[[Any], Any] | None = None,
           wrap_runner: Callable[[Any], RunnerWrapper] | None = None,
           gradio_limits: GradioLimits | None = None) -> Iterator[Served]:
    """app.py's flow (settings, server, engine, queued demo, mount) on the tiny model with the eager backend.

    `engine(settings)` may build the engine instead (e.g. with a failing compiler); `wrap_runner(runner)` wraps the
    engine's runner at construction (the wrapper is `Served.runner`); `gradio_limits` bounds what the server lets
    Gradio keep (smaller than the app's, to see them hold); flags come after the defaults.
    """
    wrapped = []  # the one wrapper, once the engine is built

    def wrap(inner):
        wrapped.append(wrap_runner(inner))
        return wrapped[-1]

    if wrap_runner:
        assert engine is None, "give served() an engine factory or a runner wrapper, not both"
        def engine(settings):
            return build_engine(settings, wrap_runner=wrap)

    saved = dict(os.environ)
    os.environ.update(environ or {})
    torch._dynamo.reset()
    argv = ["--model", "tiny", "--compile-backend", "eager", "--resolutions", "256x256,384x256",
            "--cache-dir", str(cache_dir), "--host", "127.0.0.1", "--port", str(free_port()), *flags]
    server = None
    try:
        settings = parse_settings(argv)
        server = Server(settings, gradio_limits=gradio_limits).start()  # as main() starts it, with the limits
        stops = SessionStops()
        app = build_app(settings, engine(settings) if engine else None, stops=stops)
        server.mount(app.engine, app.demo, stops, app.handlers.studio.jobs)
        yield Served(app.engine, app.demo, server, settings, stops, app.handlers, wrapped[0] if wrapped else None)
    finally:
        if server is not None:
            server.stop()
        os.environ.clear()
        os.environ.update(saved)  # build_app pointed TORCHINDUCTOR_CACHE_DIR at cache_dir
        torch._dynamo.reset()


def connect(url: str, folder, **kwargs) -> Client:
    kwargs.setdefault("download_files", str(folder))
    return Client(url, analytics_enabled=False, verbose=False, httpx_kwargs={"timeout": TIMEOUT}, **kwargs)


def call(client: Client, *args, api_name: str = "/generate"):
    return client.submit(*args, api_name=api_name).result(timeout=TIMEOUT)


class GatedRunner(RunnerWrapper):
    """The engine's runner, recording every pipeline call (seeds as they start, (seed, start, end) as they end) and
    when each step ended; hold() keeps the next call (a compile or an image) off the pipeline until open(), and
    `holding` is set once one waits there."""

    def __init__(self, inner):
        super().__init__(inner)
        self.calls: list[tuple[int, float, float]] = []  # (seed, start, end) in the order they ran
        self.seeds: list[int] = []  # in the order they started
        self.step_ends: list[float] = []  # time.perf_counter() at the end of each step of an image
        self.started = threading.Event()  # a call got past the gate
        self.active = self.most_active = 0
        self._lock = threading.Lock()
        self._gate = threading.Event()
        self._gate.set()
        self.holding = threading.Event()

    def hold(self) -> None:
        self.holding.clear()
        self._gate.clear()

    def open(self) -> None:
        self._gate.set()

    def __call__(self, call, callback=None):
        with self._lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            if not self._gate.is_set():
                self.holding.set()
                assert self._gate.wait(TIMEOUT), "the gate was never opened"
            self.seeds.append(call.seed)
            self.started.set()

            def timed(pipe, step, timestep, kwargs):
                self.step_ends.append(time.perf_counter())
                return callback(pipe, step, timestep, kwargs)

            start = time.monotonic()
            image = self.inner(call, timed if callback else None)
            self.calls.append((call.seed, start, time.monotonic()))
            return image
        finally:
            with self._lock:
                self.active -= 1
