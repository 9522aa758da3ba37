"""Prometheus metrics for one engine, in a registry of their own, served at /metrics."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from neuron_ui.contract.errors import ErrorKind
    from neuron_ui.contract.results import CacheEvent, GenerateResult


LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


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
        self.queue_depth.set_function(lambda: self._waiting())
        self.busy = Gauge("neuron_ui_device_busy", "1 while a request or a warm-up runs on the device", registry=r)
        self.busy.set_function(lambda: self._engine is not None and self._engine.status().busy)
        self.loaded = Gauge("neuron_ui_model_loaded", "1 once the model is loaded and the UI served", registry=r)
        self.persistent = Gauge("neuron_ui_cache_persistent",
                                "1 when compiled shapes survive a restart; 0 when the cache folder is unusable",
                                registry=r)
        self.persistent.set_function(lambda: self._engine is not None and self._engine.status().persistent_cache)
        self.held = Gauge("neuron_ui_gradio_held", "Records Gradio holds per session or event, each bounded "
                          "(docs/operations.md#memory)", ["record"], registry=r)
        self._engine = None
        self._waiting: Callable[[], int] = lambda: 0

    def attach(self, engine, waiting: Callable[[], int], held: Callable[[], dict[str, int]]) -> None:
        """Observe `engine`; `waiting` counts requests not yet on the device, `held()` what Gradio holds, served as
        neuron_ui_gradio_held{record=...}; both read at each scrape."""
        self._engine = engine
        self._waiting = waiting
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
