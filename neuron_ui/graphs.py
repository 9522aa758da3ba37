"""Compile bookkeeping, apart from the request flow: which transformer graphs are held (one per sequence length),
what each layout cost, and what the next one will cost, from the manifest.

The in-process engine keeps one book for the graphs it compiles; the replicas' front keeps one over the same
manifest for what no replica holds yet. No torch here: the front and the UI's process need not load it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from . import compilation
from . import references as refs
from .compilation import Backend, CacheManifest, CompileKey
from .resolutions import Resolution
from .schema import COLD, COMPILING, FAILED, READY, ShapeStatus, validate_resolution


@dataclass(frozen=True)
class Layout:
    """What the transformer's image sequence is made of: the output, the source image when inpainting (the
    inpaint pipeline appends its latents as a condition), and each reference. Its length is the graph's shape."""

    resolution: Resolution
    references: tuple[Resolution, ...] = ()
    inpaint: bool = False

    @property
    def tokens(self) -> int:
        return self.resolution.tokens * (2 if self.inpaint else 1) + sum(r.tokens for r in self.references)

    @property
    def plain(self) -> bool:
        return not self.references and not self.inpaint

    def __str__(self) -> str:
        text = f"inpaint {self.resolution}" if self.inpaint else str(self.resolution)
        if self.references:
            sizes = sorted({str(r) for r in self.references})
            count = len(self.references)
            text += f" + {count} ref{'s' if count > 1 else ''} {', '.join(sizes)}"
        return text


@dataclass(frozen=True)
class Layouts:
    """The layouts a server allows: its presets, plain or inpainted, with 0..max references of one size."""

    presets: tuple[Resolution, ...]
    reference_sizes: tuple[Resolution, ...] = refs.REFERENCE_SIZES
    max_references: int = 2

    def all(self) -> list[Layout]:
        reference_sets = [()] + [(size,) * count for size in self.reference_sizes
                                 for count in range(1, self.max_references + 1)]
        return [Layout(p, r, inpaint) for p in self.presets for inpaint in (False, True) for r in reference_sets]

    def layout(self, resolution: str, references: int = 0, reference_size: str | None = None,
               inpaint: bool = False) -> Layout:
        """The layout a request would make; ValueError names what is allowed."""
        preset = validate_resolution(resolution, self.presets)
        if not isinstance(references, int) or not 0 <= references <= self.max_references:
            raise ValueError(f"references must be 0 to {self.max_references}, got {references!r}")
        if not references:
            return Layout(preset, (), inpaint)
        size = refs.validate_reference_size(reference_size or str(self.reference_sizes[0]), self.reference_sizes)
        return Layout(preset, (size,) * references, inpaint)


T = TypeVar("T")


class WarmupList(Generic[T]):
    """Sizes to compile in the background, one after another on one thread, each listed until it is done; the
    engine and the replicas' front both keep one. `warm(item)` compiles one; it returns False to drop the rest
    (shutting down)."""

    def __init__(self, warm: Callable[[T], bool]):
        self._warm = warm
        self._lock = threading.Lock()
        self._items: list[T] = []
        self._thread: threading.Thread | None = None

    def add(self, items: list[T]) -> None:
        with self._lock:
            self._items.extend(item for item in items if item not in self._items)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="warmup", daemon=True)
                self._thread.start()

    def pending(self) -> list[T]:
        """What is still to compile, the one compiling now first."""
        with self._lock:
            return list(self._items)

    def wait(self, timeout: float | None = None) -> bool:
        """True once the list is done (for tests and for scripts that want a warm server)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._items:
                    return
                item = self._items[0]
            try:
                go_on = self._warm(item)
            finally:
                with self._lock:
                    self._items.remove(item)
            if not go_on:
                with self._lock:
                    self._items.clear()
                return


@dataclass
class GraphState:
    """The transformer graph for one sequence length; layouts with the same total share it."""

    state: str
    compiled_by: Layout
    seconds: float | None = None
    error: str | None = None
    event: str | None = None  # compiled or disk_hit, once ready


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
    def phase(self) -> str:
        return "loading" if self.loading else "compiling"

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

    # -- what the compiling side tells the book -------------------------------------------------------

    def claim(self, layout: Layout) -> Claim | None:
        """None when this layout's graph is held; else mark it compiling and say what it should cost.
        Callers serialise claims (the engine's device queue), so one graph is compiled once."""
        if self.compile_mode == "eager":
            return None
        with self._lock:
            graph = self._graphs.get(layout.tokens)
            if graph is not None and graph.state == READY:
                return None
            self._graphs[layout.tokens] = GraphState(COMPILING, compiled_by=layout)
        return Claim(layout, bool(self.disk_records(layout)), self.estimate(layout), self.estimate_is_guess(layout))

    def failed(self, layout: Layout, reason: str) -> None:
        with self._lock:
            self._graphs[layout.tokens] = GraphState(FAILED, compiled_by=layout, error=reason)

    def ready(self, layout: Layout, seconds: float, event: str, persistent: bool) -> None:
        """The graph is held; recorded in the manifest only when it was compiled into the persistent folder."""
        with self._lock:
            self._graphs[layout.tokens] = GraphState(READY, compiled_by=layout, seconds=seconds, event=event)
        if persistent:
            self.manifest.record(self.key, str(layout), layout.tokens, seconds, event)

    def image(self, layout: Layout, event: str, latency: float) -> None:
        with self._lock:
            stats = self._stats.setdefault(layout, LayoutStats())
            stats.images += 1
            stats.hits += event == compilation.MEMORY_HIT
            stats.last_latency = latency

    def seen(self, layout: Layout) -> None:
        """List this layout in the status from now on (a warm-up made it, with no image yet)."""
        with self._lock:
            self._stats.setdefault(layout, LayoutStats())

    def held(self) -> list[int]:
        """The token counts whose graph is ready here."""
        with self._lock:
            return sorted(tokens for tokens, graph in self._graphs.items() if graph.state == READY)

    # -- estimates and status ----------------------------------------------------------------------

    def disk_records(self, layout: Layout) -> list[compilation.ShapeRecord]:
        """What the persistent cache holds for this layout's graph (its own record first)."""
        records = self.manifest.shapes(self.key)
        same_graph = [r for r in records.values() if r.tokens == layout.tokens]
        return sorted(same_graph, key=lambda r: r.resolution != str(layout))

    def estimate(self, layout: Layout) -> float | None:
        """Seconds until this layout's graph is ready: a load when its graph is on disk, else a compile."""
        return compilation.estimate_compile_seconds(self.manifest.shapes(self.key), str(layout), self.backend,
                                                    on_disk=self.disk_records(layout))

    def estimate_is_guess(self, layout: Layout) -> bool:
        """True when the estimate is the built-in default: no graph on disk, no compile measured by this key."""
        records = self.manifest.shapes(self.key).values()
        return not self.disk_records(layout) and not any(map(compilation.measured_cold_seconds, records))

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
            state=COLD,
            on_disk=bool(disk),
            warmup_queued=layout.plain and layout.resolution in warmup,
            hits=stats.hits,
            images=stats.images,
            last_latency=stats.last_latency,
            layout=None if layout.plain else str(layout),
        )
        if self.compile_mode == "eager":
            shape.state = READY
        elif graph is not None:
            shape.state = graph.state
            shape.error = graph.error
            if graph.compiled_by != layout:
                shape.shares_graph_with = str(graph.compiled_by)
            elif graph.event == compilation.DISK_HIT:
                shape.load_seconds = graph.seconds
            else:
                shape.compile_seconds = graph.seconds
        if shape.state != READY:
            estimate = self.estimate(layout)
            shape.estimate_seconds = None if estimate is None else round(estimate, 1)
            shape.estimate_guess = self.estimate_is_guess(layout)
            if disk and shape.compile_seconds is None and shape.load_seconds is None:
                shape.compile_seconds = compilation.measured_cold_seconds(disk[0])
                shape.load_seconds = compilation.measured_load_seconds(disk[0])
        return shape

    def used(self) -> list[Layout]:
        """Editing layouts (not plain presets) used or warmed up here, for the status's layouts section."""
        with self._lock:
            return [layout for layout in self._stats if not layout.plain]
