"""Compile bookkeeping, apart from the request flow: which transformer graphs are held (one per sequence length),
what each layout cost, and what the next one will cost, from the manifest.

The in-process engine keeps one book for the graphs it compiles; the replicas' front keeps one over the same
manifest that takes what the replicas' own books hold (take()), so its status is built the same way. No torch here:
the front and the UI's process need not load it.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from neuron_ui.cache.estimates import estimate_compile_seconds, measured_seconds
from neuron_ui.contract.layouts import Layout
from neuron_ui.contract.results import CacheEvent, ProgressUpdate, ShapeState, ShapeStatus
from neuron_ui.contract.stopping import Phase

if TYPE_CHECKING:
    from neuron_ui.cache.manifest import CacheManifest, ShapeRecord
    from neuron_ui.compile.key import CompileKey


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
    """One layout's images: ShapeStatus's fields of the same names."""

    images: int = 0  # images made at this layout, whatever the cache did
    hits: int = 0  # ... of which found the graph in memory
    last_latency: float | None = None


FIRST = (Phase.READY, Phase.COMPILING, Phase.FAILED)  # a graph over several books: the first of these any holds


class Holdings(NamedTuple):
    """What a book holds, as plain values: a replica reports its own; the front's book takes them all."""

    graphs: dict[int, GraphState]
    stats: dict[Layout, LayoutStats]

    def ready(self) -> list[int]:
        """The token counts whose graph is ready."""
        return sorted(tokens for tokens, graph in self.graphs.items() if graph.state == Phase.READY)


class GraphBook:
    """Graph states by token count, stats by layout, and estimates from the manifest; thread-safe."""

    def __init__(self, key: CompileKey, manifest: CacheManifest, parameters: int | None = None):
        self.key = key
        self.manifest = manifest
        self.parameters = parameters  # the transformer's: what the built-in guess scales with
        self.compile_mode = key.mode
        self._lock = threading.Lock()
        self._graphs: dict[int, GraphState] = {}
        self._stats: dict[Layout, LayoutStats] = {}  # the layouts used

    def claim(self, layout: Layout) -> ProgressUpdate | None:
        """None when this layout's graph is held; else mark it compiling and say what it should cost: the update a
        caller about to compile it (or load it from the disk cache) reports. Callers serialise claims (the engine's
        device queue), so one graph is compiled once."""
        if self.compile_mode == "eager":
            return None
        with self._lock:
            graph = self._graphs.get(layout.tokens)
            if graph is not None and graph.state == Phase.READY:
                return None
            self._graphs[layout.tokens] = GraphState(Phase.COMPILING, compiled_by=layout)
        phase = Phase.LOADING if self.disk_records(layout) else Phase.COMPILING
        estimate, guess = self.estimate(layout)
        about = "load time not measured yet" if estimate is None else f"about {estimate:.0f} s"
        about += ", a guess: nothing measured on this machine yet" if guess else ""
        where = " from the disk cache" if phase is Phase.LOADING else ""
        return ProgressUpdate(Phase.COMPILING, f"{phase} {layout}{where} for the first time ({about})", phase=phase,
                              estimate_seconds=estimate, guess=guess)

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

    def holdings(self) -> Holdings:
        with self._lock:
            return Holdings(dict(self._graphs), {layout: replace(stats) for layout, stats in self._stats.items()})

    def take(self, holdings: list[Holdings]) -> None:
        """Hold what these books hold (the healthy replicas'), in place of what it held: a graph ready where any
        holds it, else compiling where any compiles it, else failed; each layout's images and hits summed, the first
        latency heard."""
        tokens = {count for held in holdings for count in held.graphs}
        graphs = {count: min((held.graphs[count] for held in holdings if count in held.graphs),
                             key=lambda graph: FIRST.index(graph.state)) for count in tokens}
        stats: dict[Layout, LayoutStats] = {}
        for held in holdings:
            for layout, each in held.stats.items():
                total = stats.setdefault(layout, LayoutStats())
                total.images += each.images
                total.hits += each.hits
                total.last_latency = each.last_latency if total.last_latency is None else total.last_latency
        with self._lock:
            self._graphs, self._stats = graphs, stats

    def compile_left(self, layout: Layout) -> float | None:
        """Seconds a request at `layout` would compile before its image: 0.0 when held, None when unknown."""
        with self._lock:
            graph = self._graphs.get(layout.tokens)
        if self.compile_mode == "eager" or (graph is not None and graph.state == Phase.READY):
            return 0.0
        return self.estimate(layout)[0]

    def disk_records(self, layout: Layout) -> list[ShapeRecord]:
        """What the persistent cache holds for this layout's graph (its own record first)."""
        records = self.manifest.shapes(self.key)
        same_graph = [r for r in records.values() if r.tokens == layout.tokens]
        return sorted(same_graph, key=lambda r: r.resolution != str(layout))

    def estimate(self, layout: Layout) -> tuple[float | None, bool]:
        """Seconds until this layout's graph is ready (a load when its graph is on disk, else a compile; None when no
        load was measured yet), and whether that is the built-in default: no graph on disk, no compile measured by
        this key."""
        records, disk = self.manifest.shapes(self.key), self.disk_records(layout)
        guess = not disk and not any(measured_seconds(r, CacheEvent.COMPILED) for r in records.values())
        return estimate_compile_seconds(records, self.key.backend, disk, layout.tokens, self.parameters), guess

    def status(self, layout: Layout, warmup: list[Layout]) -> ShapeStatus:
        """One layout's state, e.g. for the status table or the line under the form before the click (`warmup`: the
        presets still to warm up)."""
        with self._lock:
            stats = self._stats.get(layout, LayoutStats())
            graph = self._graphs.get(layout.tokens)
        disk = self.disk_records(layout)
        shape = ShapeStatus(str(layout.resolution), layout.resolution.aspect, layout.tokens, Phase.COLD,
                            on_disk=bool(disk), warmup_queued=layout.plain and layout in warmup,
                            layout=None if layout.plain else str(layout), **asdict(stats))
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
            estimate, shape.estimate_guess = self.estimate(layout)
            shape.estimate_seconds = None if estimate is None else round(estimate, 1)
            if disk:  # earlier runs' measurements, kept apart from this run's
                shape.recorded_compile_seconds = measured_seconds(disk[0], CacheEvent.COMPILED)
                shape.recorded_load_seconds = measured_seconds(disk[0], CacheEvent.DISK_HIT)
        return shape

    def used(self) -> list[Layout]:
        """Editing layouts (not plain presets) used or warmed up here, for the status's layouts section."""
        with self._lock:
            return [layout for layout in self._stats if not layout.plain]
