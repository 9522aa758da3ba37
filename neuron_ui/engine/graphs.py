"""Compile bookkeeping, apart from the request flow: which transformer graphs are held (one per sequence length),
what each layout cost, and what the next one will cost, from the manifest.

The in-process engine keeps one book for the graphs it compiles; the replicas' front keeps one over the same
manifest for what no replica holds yet. No torch here: the front and the UI's process need not load it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from neuron_ui.cache.estimates import estimate_compile_seconds, measured_cold_seconds, measured_load_seconds
from neuron_ui.contract.layouts import Layout
from neuron_ui.contract.results import CacheEvent, ShapeState, ShapeStatus
from neuron_ui.contract.stopping import Phase

if TYPE_CHECKING:
    from neuron_ui.cache.manifest import CacheManifest, ShapeRecord
    from neuron_ui.compile.key import CompileKey
    from neuron_ui.compile.strategies import Backend
    from neuron_ui.config.resolutions import Resolution


@dataclass
class GraphState:
    """The transformer graph for one sequence length; layouts with the same total share it."""

    state: ShapeState
    compiled_by: Layout
    seconds: float | None = None
    error: str | None = None
    event: CacheEvent | None = None  # compiled or disk_hit, once ready


@dataclass
class LayoutStats:
    images: int = 0  # images made at this layout, whatever the cache did
    hits: int = 0  # ... of which found the graph in memory
    last_latency: float | None = None


@dataclass(frozen=True)
class Claim:
    """A graph this caller is now to compile (or load from the disk cache), and what that should cost."""

    layout: Layout
    loading: bool  # its graph is on disk: a load, not a compile
    estimate: float | None  # seconds; None when no load was measured yet
    guess: bool = False  # the estimate is the built-in default: nothing measured on this machine yet

    @property
    def phase(self) -> Phase:
        return Phase.LOADING if self.loading else Phase.COMPILING

    def describe(self) -> str:
        where = " from the disk cache" if self.loading else ""
        about = "load time not measured yet" if self.estimate is None else f"about {self.estimate:.0f} s"
        about += ", a guess: nothing measured on this machine yet" if self.guess else ""
        return f"{self.phase} {self.layout}{where} for the first time ({about})"


class GraphBook:
    """Graph states by token count, stats by layout, and estimates from the manifest; thread-safe."""

    def __init__(self, key: CompileKey, manifest: CacheManifest, compile_mode: str, backend: Backend,
                 presets: tuple[Resolution, ...] = ()):
        self.key = key
        self.manifest = manifest
        self.compile_mode = compile_mode
        self.backend = backend
        self._lock = threading.Lock()
        self._graphs: dict[int, GraphState] = {}
        self._stats = {Layout(preset): LayoutStats() for preset in presets}  # other layouts join when used

    def claim(self, layout: Layout) -> Claim | None:
        """None when this layout's graph is held; else mark it compiling and say what it should cost.
        Callers serialise claims (the engine's device queue), so one graph is compiled once."""
        if self.compile_mode == "eager":
            return None
        with self._lock:
            graph = self._graphs.get(layout.tokens)
            if graph is not None and graph.state == Phase.READY:
                return None
            self._graphs[layout.tokens] = GraphState(Phase.COMPILING, compiled_by=layout)
        return Claim(layout, bool(self.disk_records(layout)), self.estimate(layout), self.estimate_is_guess(layout))

    def failed(self, layout: Layout, reason: str) -> None:
        with self._lock:
            self._graphs[layout.tokens] = GraphState(Phase.FAILED, compiled_by=layout, error=reason)

    def ready(self, layout: Layout, seconds: float, event: CacheEvent, persistent: bool) -> None:
        """The graph is held; recorded in the manifest only when it was compiled into the persistent folder."""
        with self._lock:
            self._graphs[layout.tokens] = GraphState(Phase.READY, compiled_by=layout, seconds=round(seconds, 3),
                                                     event=event)
        if persistent:
            self.manifest.record(self.key, str(layout), layout.tokens, seconds, event)

    def image(self, layout: Layout, event: CacheEvent, latency: float) -> None:
        with self._lock:
            stats = self._stats.setdefault(layout, LayoutStats())
            stats.images += 1
            stats.hits += event == CacheEvent.MEMORY_HIT
            stats.last_latency = round(latency, 3)

    def seen(self, layout: Layout) -> None:
        """List this layout in the status from now on (a warm-up made it, with no image yet)."""
        with self._lock:
            self._stats.setdefault(layout, LayoutStats())

    def held(self) -> list[int]:
        """The token counts whose graph is ready here."""
        with self._lock:
            return sorted(tokens for tokens, graph in self._graphs.items() if graph.state == Phase.READY)

    def disk_records(self, layout: Layout) -> list[ShapeRecord]:
        """What the persistent cache holds for this layout's graph (its own record first)."""
        records = self.manifest.shapes(self.key)
        same_graph = [r for r in records.values() if r.tokens == layout.tokens]
        return sorted(same_graph, key=lambda r: r.resolution != str(layout))

    def estimate(self, layout: Layout) -> float | None:
        """Seconds until this layout's graph is ready: a load when its graph is on disk, else a compile."""
        return estimate_compile_seconds(self.manifest.shapes(self.key), str(layout), self.backend,
                                                    on_disk=self.disk_records(layout), tokens=layout.tokens)

    def estimate_is_guess(self, layout: Layout) -> bool:
        """True when the estimate is the built-in default: no graph on disk, no compile measured by this key."""
        records = self.manifest.shapes(self.key).values()
        return not self.disk_records(layout) and not any(map(measured_cold_seconds, records))

    def status(self, layout: Layout, warmup: list[Resolution] | tuple[Resolution, ...] = ()) -> ShapeStatus:
        """One layout's state, e.g. for the status table or the line under the form before the click."""
        with self._lock:
            stats = self._stats.get(layout, LayoutStats())
            graph = self._graphs.get(layout.tokens)
        disk = self.disk_records(layout)
        shape = ShapeStatus(
            resolution=str(layout.resolution),
            aspect=layout.resolution.aspect,
            tokens=layout.tokens,
            state=Phase.COLD,
            on_disk=bool(disk),
            warmup_queued=layout.plain and layout.resolution in warmup,
            hits=stats.hits,
            images=stats.images,
            last_latency=stats.last_latency,
            layout=None if layout.plain else str(layout),
        )
        if self.compile_mode == "eager":
            shape.state = Phase.READY
        elif graph is not None:
            shape.state = graph.state
            shape.error = graph.error
            if graph.compiled_by != layout:
                shape.shares_graph_with = str(graph.compiled_by)
            # A size that shares a graph gives the graph's time too: /status and the table read this one field.
            if graph.event == CacheEvent.DISK_HIT:
                shape.load_seconds = graph.seconds
            else:
                shape.compile_seconds = graph.seconds
        if shape.state != Phase.READY:
            estimate = self.estimate(layout)
            shape.estimate_seconds = None if estimate is None else round(estimate, 1)
            shape.estimate_guess = self.estimate_is_guess(layout)
            if disk:  # earlier runs' measurements, kept apart from this run's
                shape.recorded_compile_seconds = measured_cold_seconds(disk[0])
                shape.recorded_load_seconds = measured_load_seconds(disk[0])
        return shape

    def used(self) -> list[Layout]:
        """Editing layouts (not plain presets) used or warmed up here, for the status's layouts section."""
        with self._lock:
            return [layout for layout in self._stats if not layout.plain]
