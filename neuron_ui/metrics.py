"""Prometheus metrics for one engine, in a registry of their own, served at /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .schema import GenerateResult

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)


class EngineMetrics:
    """An engine observer that counts images, errors, compilations and cache events, and times requests."""

    def __init__(self, engine, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.images = Counter("neuron_ui_images", "Images generated", ["resolution", "cache_event"], registry=r)
        self.errors = Counter("neuron_ui_errors", "Requests that failed, by kind", ["kind"], registry=r)
        self.compilations = Counter(
            "neuron_ui_compilations", "Shape compilations, by cache event", ["resolution", "cache_event"], registry=r
        )
        self.compile_seconds = Counter(
            "neuron_ui_compile_seconds", "Seconds spent compiling shapes", ["resolution"], registry=r
        )
        self.latency = Histogram(
            "neuron_ui_generation_seconds", "Request latency, compilation included", ["resolution"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_depth = Gauge("neuron_ui_queue_depth", "Requests waiting for the device", registry=r)
        self.queue_depth.set_function(lambda: engine.status().queue_depth)
        engine.observers.append(self)

    def on_generated(self, result: GenerateResult) -> None:
        self.images.labels(result.resolution, result.cache_event).inc()
        self.latency.labels(result.resolution).observe(result.total_seconds)

    def on_compiled(self, resolution: str, event: str, seconds: float) -> None:
        self.compilations.labels(resolution, event).inc()
        self.compile_seconds.labels(resolution).inc(seconds)

    def on_failed(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
