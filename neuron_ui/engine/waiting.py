"""What a waiting user is told: how many images are ahead (the ones on the device counted), about how long (an
estimate, from each layout's last latency, scaled by token count for a layout not measured yet, shared among the
device's slots: one per replica), and how far the wait has come (the bar's fraction); all from the front's own
measurements and its runner's estimates. The one place for these words, in one process or over replicas."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from neuron_ui.contract.results import ProgressUpdate
from neuron_ui.contract.stopping import Phase

if TYPE_CHECKING:
    from neuron_ui.contract.layouts import Layout

WAIT_WORTH_TELLING = 0.5  # seconds of waiting below which the line under the image does not mention it
MOST_OF_A_WAIT = 0.99  # the bar never reads 100% while the request still waits


@dataclass(frozen=True)
class OnDevice:
    """What holds the device now, for the users waiting behind it: a compile or an image, and since when."""

    kind: Phase  # COMPILING (or loading) a graph, or RUNNING an image
    layout: Layout
    started: float  # the watch's clock
    expected: float | None  # seconds it should take in all, from the engine's estimates; None when unknown


@dataclass
class Wait:
    """What one request waited for, as it learns it while waiting, and since when (the bar's start)."""

    what: str | None = None
    started: float | None = None


def images_ahead(count: int, mine: int = 0, on_device: str | None = None) -> str:
    """ "3 images ahead of yours (one at 1344x768 on the device now, 1 from you)"."""
    notes = [f"{'one' if count > 1 else ''} at {on_device} on the device now".strip()] if on_device else []
    notes += [f"{mine} from you"] if mine else []
    text = f"{count} image{'s' if count != 1 else ''} ahead of yours"
    return f"{text} ({', '.join(notes)})" if notes else text


class DeviceWatch:
    """What holds the device (each of its `slots`: replicas) and what each layout's last image took, kept for the
    users waiting behind it. `compile_left(layout)` says how long a layout would compile first (0.0: held; None:
    unknown); `clock` is the time it reads (a test's own)."""

    def __init__(self, compile_left: Callable[[Layout], float | None], slots: int = 1,
                 clock: Callable[[], float] = time.perf_counter):
        self.compile_left = compile_left
        self.slots = slots
        self.clock = clock
        self._lock = threading.Lock()
        self._on_device: dict[int, OnDevice] = {}  # by the thread whose request holds a slot
        self._image_seconds: dict[Layout, float] = {}  # each layout's latest pipeline run

    def compiling(self, layout: Layout, estimate: float | None) -> None:
        with self._lock:
            self._on_device[threading.get_ident()] = OnDevice(Phase.COMPILING, layout, self.clock(), estimate)

    def running(self, layout: Layout, started: float) -> None:
        with self._lock:
            estimate = self._image_estimate(layout)
            self._on_device[threading.get_ident()] = OnDevice(Phase.RUNNING, layout, started, estimate)

    def idle(self) -> None:
        with self._lock:
            self._on_device.pop(threading.get_ident(), None)

    def ran(self, layout: Layout, seconds: float) -> None:
        with self._lock:
            self._image_seconds[layout] = seconds

    def describe(self, ahead: list[Layout | None], waited: Wait, mine: int = 0) -> ProgressUpdate:
        """What a waiting user waits for and about how long: what holds the device (a compile: its estimate minus
        the time it has run; an image: counted among the images ahead), then each request ahead in the order turns
        give (`mine` of them the user's own) at its layout's latency, shared among the slots. The fraction is the
        time waited against the time waited plus the time left, so the bar moves as the wait goes (it sat at 0.0%
        for 24 s)."""
        now = self.clock()
        if waited.started is None:
            waited.started = now
        with self._lock:
            current = list(self._on_device.values())
            ahead_seconds = [self._expected_seconds(layout) for layout in ahead]
        lefts = [None if c.expected is None else max(c.expected - (now - c.started), 0.0) for c in current]
        compiles = [(c, left) for c, left in zip(current, lefts) if c.kind is Phase.COMPILING]
        images = [(c, left) for c, left in zip(current, lefts) if c.kind is Phase.RUNNING]
        parts: list[str] = []
        if compiles:
            compile, left = compiles[0]
            waited.what = f"{compile.layout} to compile"
            about = "compile time not measured yet" if left is None else f"about {seconds_text(left)} (estimate)"
            parts.append(f"waiting for {compile.layout} to compile, {about}")
        count = len(ahead) + len(images)
        if count:
            left = self._shared([left for _, left in images] + ahead_seconds)
            about = "time not measured yet for some sizes" if left is None else f"about {seconds_text(left)} (estimate)"
            words = images_ahead(count, mine, str(images[0][0].layout) if len(images) == 1 else None)
            parts.append(f"{'then ' if parts else 'waiting: '}{words}, {about}")
            if waited.what is None:
                waited.what = images_ahead(count, mine)
        fraction = None
        if (left := self._shared(lefts + ahead_seconds)) is not None:
            elapsed = now - waited.started
            fraction = min(elapsed / (elapsed + left), MOST_OF_A_WAIT) if elapsed + left > 0 else MOST_OF_A_WAIT
        return ProgressUpdate(Phase.WAITING, " · ".join(parts) or "waiting for the device", fraction=fraction)

    def _shared(self, seconds: list[float | None]) -> float | None:
        """What these runs take, shared among the slots; None when any is unknown (or there are none)."""
        known = [s for s in seconds if s is not None]
        return sum(known) / self.slots if seconds and len(known) == len(seconds) else None

    def _image_estimate(self, layout: Layout) -> float | None:
        """A layout's image seconds: its own last one, else the nearest measured layout's in proportion to the
        tokens (what differs between them). Called under the lock."""
        if layout in self._image_seconds:
            return self._image_seconds[layout]
        if not self._image_seconds:
            return None
        nearest = min(self._image_seconds, key=lambda other: abs(other.tokens - layout.tokens))
        return self._image_seconds[nearest] * layout.tokens / max(nearest.tokens, 1)

    def _expected_seconds(self, layout: Layout | None) -> float | None:
        """Seconds a request at `layout` should hold the device: its compile (unless held) and its image; None
        when not known (a request whose layout the queue was not told)."""
        if layout is None:
            return None
        image = self._image_estimate(layout)
        compile = None if image is None else self.compile_left(layout)
        return None if image is None or compile is None else compile + image


def seconds_text(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
