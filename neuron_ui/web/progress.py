"""Progress as users read it, for Gradio's bar and MCP's notifications: stages, and a ticker while a compile runs
(the step previews go their own way: studio.Asker.tell, and the stream of studio/bridge.py)."""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from neuron_ui.contract.stopping import Phase

if TYPE_CHECKING:
    from neuron_ui.contract.results import ProgressUpdate

TICK_SECONDS = 1.0  # how often a compile's elapsed time is re-reported while it runs
GUESS = "a guess: nothing measured on this machine yet"


class ProgressBar(Protocol):
    """What shows a request's progress: gr.Progress, or a door's own (MCP's notifications, a test's recorder)."""

    def __call__(self, fraction: float, /, *, desc: str | None = None, unit: str = "steps") -> object: ...


@dataclass
class CompileWait:
    """A compilation in progress as one request reported it: what, since when, and for about how long."""

    message: str  # the engine's words, e.g. "compiling 1344x768 for the first time (about 41 s)"
    phase: Phase | None
    estimate: float | None
    guess: bool
    started: float

    def describe(self, now: float) -> tuple[float, str]:
        """The progress bar's value and words: elapsed against the estimate, labelled as an estimate (or a guess).
        A value, never Gradio's count of unknown length, which shows a bare "4 s" without the words (6.31)."""
        elapsed = now - self.started
        head = self.message.split(" (")[0]  # the engine's words without its "(about N s)"
        if self.phase == Phase.LOADING:  # "loading 1344x768 from the disk cache (about 3 s)"
            head = head.replace(" for the first time", "")
        phase = f"{self.phase}: " if self.phase and not head.startswith(self.phase) else ""
        if self.estimate is None:
            return 0.0, f"{phase}{head} · {elapsed:.0f} s so far (time not measured yet)"
        label = GUESS if self.guess else "estimate"
        fraction = min(elapsed / self.estimate, 0.99) if self.estimate > 0 else 0.99
        if self.phase == Phase.LOADING:
            return fraction, f"{head} (about {self.estimate:.0f} s, {label}) · {elapsed:.0f} s so far"
        return fraction, f"{phase}{head} · {elapsed:.0f} s of about {self.estimate:.0f} s ({label})"


class ProgressReporter:
    """Maps the engine's ProgressUpdate onto gr.Progress: waiting, compiling, steps, decoding.

    A compile reports once, at its start, then blocks for its whole length: a ticker thread re-reports it every
    TICK_SECONDS with the time elapsed against the estimate, so the bar moves and says how long (it sat at 0.0%).
    `on_compile` hears the compile start (a CompileWait) and end (None), for the line every browser sees;
    `clock` and `tick` are the time it reads and how often it re-reports (a test's own).
    Use it as a context manager, so the ticker stops when the request ends, however it ends.
    """

    def __init__(self, progress: ProgressBar, prefix: str = "",
                 on_compile: Callable[[CompileWait | None], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, tick: float = TICK_SECONDS):
        self.progress = progress
        self.prefix = prefix
        self.on_compile = on_compile or (lambda wait: None)
        self.clock = clock
        self.tick = tick
        self.compile: CompileWait | None = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_ticker()
        if self.compile is not None:
            self.compile = None
            self.on_compile(None)

    def __call__(self, update: ProgressUpdate) -> None:
        self._stop_ticker()
        if update.stage == Phase.COMPILING:
            started = self.compile.started if self.compile else self.clock()  # a new phase of the same wait
            self.compile = CompileWait(update.message, update.phase, update.estimate_seconds, update.guess, started)
            self.on_compile(self.compile)
            self._show_compile()
            self._stop = threading.Event()
            # gr.Progress finds its request through context variables: the ticker runs in a copy of this context.
            context = contextvars.copy_context()
            self._ticker = threading.Thread(target=context.run, args=(self._tick, self._stop),
                                            name="compile-progress", daemon=True)
            self._ticker.start()
            return
        if self.compile is not None:
            self.compile = None
            self.on_compile(None)
        # Gradio shows no text for a None fraction, so a stage of unknown length shows as 0%.
        self.progress(update.fraction or 0.0, desc=self.prefix + update.message)

    def _show_compile(self) -> None:
        wait = self.compile
        if wait is not None:
            value, words = wait.describe(self.clock())
            self.progress(value, desc=self.prefix + words, unit="s")

    def _tick(self, stop: threading.Event) -> None:
        while not stop.wait(self.tick):
            self._show_compile()

    def _stop_ticker(self) -> None:
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join(timeout=2)
        self._ticker = None
