"""The messages a replica's stream carries to the front, one frozen dataclass each, in the order they come:

    Started(replica)                       the request left the router and began on this replica
    Progress(update, phase) ...            progress lines, each with where the request is now if that changed
                                           (queued, compiling, running: neuron_ui.contract.stopping's phases)
    Preview(step, steps, png, phase) ...   a step's estimate of the image, for a request that asked (a small PNG)
    Compiled(resolution, event, seconds)   each compilation the request caused, after it ended
    Done(value) | Failed(kind, message)    the result, or the error as a value, so its kind survives the trip

The deployment (neuron_ui.replicas.deployment) sends them; the front (neuron_ui.replicas.stream) reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from neuron_ui.contract.errors import EngineError, ErrorKind
from neuron_ui.contract.results import CacheEvent, GenerateResult, ProgressUpdate, ShapeStatus, StepPreview
from neuron_ui.contract.stopping import Phase, Stopped


@dataclass(frozen=True)
class Started:
    """First on every stream: the request is on `replica` now, no longer waiting in the router."""

    replica: str


@dataclass(frozen=True)
class Progress:
    """One progress line, as the engine reported it."""

    update: ProgressUpdate
    phase: Phase | None = None  # where the request went since the message before (what a stop would still save)


@dataclass(frozen=True)
class Preview:
    """A step's estimate of the image, encoded: a PNG at the latents' resolution is a few kB, raw RGB 49 kB."""

    step: int
    steps: int
    png: bytes
    phase: Phase | None = None  # as Progress's

    def update(self) -> ProgressUpdate:
        """The engine's progress update again, at the front."""
        preview = StepPreview.from_png(self.step, self.steps, self.png)
        return ProgressUpdate(Phase.DENOISING, f"step {self.step}/{self.steps}", self.step / self.steps,
                              preview=preview)


def progress_message(update: ProgressUpdate) -> Progress | Preview:
    """What the stream carries for one of the engine's progress updates."""
    if update.preview is not None:
        return Preview(update.preview.step, update.preview.steps, update.preview.png())
    return Progress(update)


@dataclass(frozen=True)
class Compiled:
    """A compilation on the replica, told to the front's observers (e.g. /metrics) as the engine told it."""

    resolution: str
    event: CacheEvent
    seconds: float


Value = GenerateResult | ShapeStatus  # what a call of the deployment gives: generate's, warmup's


@dataclass(frozen=True)
class Done:
    """Last on a stream that succeeded: a GenerateResult for generate, a ShapeStatus for warmup."""

    value: Value


@dataclass(frozen=True)
class Failed:
    """Last on a stream that failed: the engine's error by kind and one line, raised again at the front."""

    kind: ErrorKind
    message: str

    @classmethod
    def of(cls, error: Exception) -> Failed:
        """ValueError is bad input, EngineError (Stopped included) keeps its kind, anything else is one line."""
        if isinstance(error, ValueError):
            return cls(ErrorKind.INVALID_REQUEST, str(error))
        if isinstance(error, EngineError):
            return cls(error.kind, str(error))
        return cls(ErrorKind.GENERATION_FAILED, f"the replica failed: {type(error).__name__}: {error}")

    def error(self) -> Exception:
        """The error to raise at the front: the engine's own types, so callers cannot tell replicas from an engine."""
        if self.kind == ErrorKind.INVALID_REQUEST:
            return ValueError(self.message)
        if self.kind == ErrorKind.STOPPED:
            return Stopped(self.message)
        return EngineError(self.message, kind=self.kind)


Message = Started | Progress | Preview | Compiled | Done | Failed
