"""What a waiting user is told: what holds the device (a compile or an image, since when, for about how long),
then each request ahead at its layout's last latency; all from the engine's own measurements and estimates."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from neuron_ui.contract.results import ProgressUpdate, Stage

if TYPE_CHECKING:
    from neuron_ui.contract.layouts import Layout
    from neuron_ui.engine.graphs import GraphBook

WAIT_WORTH_TELLING = 0.5  # seconds of waiting below which the line under the image does not mention it


@dataclass(frozen=True)
class OnDevice:
    """What holds the device now, for the users waiting behind it: a compile or an image, and since when."""

    kind: str  # "compile" or "image"
    layout: Layout
    started: float  # time.perf_counter()
    expected: float | None  # seconds it should take in all, from the engine's estimates; None when unknown


@dataclass
class Wait:
    """What one request waited for, as it learns it while waiting."""

    what: str | None = None


class DeviceWatch:
    """What holds the device and what each layout's last image took, kept for the users waiting behind it."""

    def __init__(self, graphs: GraphBook, compile_mode: str):
        self.graphs = graphs
        self.compile_mode = compile_mode
        self._lock = threading.Lock()
        self._on_device: OnDevice | None = None
        self._image_seconds: dict[Layout, float] = {}  # each layout's latest pipeline run

    def compiling(self, layout: Layout, estimate: float | None) -> None:
        with self._lock:
            self._on_device = OnDevice("compile", layout, time.perf_counter(), estimate)

    def running(self, layout: Layout, started: float) -> None:
        with self._lock:
            self._on_device = OnDevice("image", layout, started, self._image_seconds.get(layout))

    def idle(self) -> None:
        with self._lock:
            self._on_device = None

    def ran(self, layout: Layout, seconds: float) -> None:
        with self._lock:
            self._image_seconds[layout] = seconds

    def describe(self, ahead: list[Layout], waited: Wait, mine: int = 0) -> ProgressUpdate:
        """What a waiting user waits for and about how long: what holds the device (a compile: its estimate
        minus the time it has run), then each request ahead in the order turns give (`mine` of them the user's
        own) at its layout's latency."""
        now = time.perf_counter()
        with self._lock:
            current = self._on_device
            ahead_seconds = [self._expected_seconds(layout) for layout in ahead]
        parts = []
        if current is not None:
            left = None if current.expected is None else max(current.expected - (now - current.started), 0.0)
            if current.kind == "compile":
                waited.what = f"{current.layout} to compile"
                about = ("compile time not measured yet" if left is None
                         else f"about {seconds_text(left)} (estimate)")
                parts.append(f"waiting for {current.layout} to compile, {about}")
            else:
                about = "" if left is None else f", about {seconds_text(left)}"
                parts.append(f"waiting for an image at {current.layout} to finish{about}")
        if ahead:
            known = [s for s in ahead_seconds if s is not None]
            count = f"{len(ahead)} image{'s' if len(ahead) > 1 else ''} ahead of yours"
            count += f" ({mine} from you)" if mine else ""
            about = (f"about {seconds_text(sum(known))}" if len(known) == len(ahead)
                     else "time not measured yet for some sizes")
            parts.append(f"{'then ' if parts else 'waiting: '}{count}, {about}")
            if waited.what is None:
                waited.what = count
        if not parts:
            parts.append("waiting for the device")
        return ProgressUpdate(Stage.WAITING, " · ".join(parts))

    def _expected_seconds(self, layout: Layout) -> float | None:
        """Seconds a request at `layout` should hold the device: its compile (unless ready) and its image."""
        image = self._image_seconds.get(layout)
        if image is None or self.compile_mode == "eager":
            return image
        if layout.tokens in self.graphs.held():
            return image
        estimate = self.graphs.estimate(layout)
        return None if estimate is None else estimate + image


def seconds_text(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
