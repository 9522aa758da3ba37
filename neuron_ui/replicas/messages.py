"""The messages a replica's stream carries to the front, one frozen dataclass each, in the order they come:

    Started(replica)                       the request left the router and began on this replica
    Progress(update, phase, png) ...       progress lines, each with where the request is now if that changed
                                           (queued, compiling, running: neuron_ui.contract.stopping's phases), and
                                           a step's estimate of the image for a request that asked (a small PNG)
    Compiled(resolution, event, seconds)   each compilation the request caused, after it ended
    Done(value) | Failed(kind, message)    the result, or the error as a value, so its kind survives the trip

The deployment (neuron_ui.replicas.deployment) sends them; the front (neuron_ui.replicas.stream) reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from neuron_ui.contract.errors import EngineError, ErrorKind
from neuron_ui.contract.results import CacheEvent, GenerateResult, ProgressUpdate, ShapeStatus, StepPreview
from neuron_ui.contract.stopping import Phase, Stopped


@dataclass(frozen=True)
class Started:
    """First on every stream: the request is on `replica` now, no longer waiting in the router."""

    replica: str


@dataclass(frozen=True)
class Progress:
    """One progress line, as the engine reported it; a step's preview goes as a PNG (`png`: a few kB at the latents'
    resolution, where raw RGB is 49 kB), read back at the front (line())."""

    update: ProgressUpdate  # its preview, if any, without the pixels
    phase: Phase | None = None  # where the request went since the message before (what a stop would still save)
    png: bytes | None = None

    @classmethod
    def of(cls, update: ProgressUpdate) -> Progress:
        """What the stream carries for one of the engine's progress updates."""
        if update.preview is None:
            return cls(update)
        return cls(replace(update, preview=replace(update.preview, rgb=b"")), png=update.preview.png())

    def line(self) -> ProgressUpdate:
        """The engine's progress update again, at the front."""
        kept = self.update.preview
        if self.png is None or kept is None:
            return self.update
        return replace(self.update, preview=StepPreview.from_png(kept.step, kept.steps, self.png))


@dataclass(frozen=True)
class Compiled:
    """A compilation on the replica, told to the front's observers (e.g. /metrics) as the engine told it."""

    resolution: str
    event: CacheEvent
    seconds: float


RAISED: dict[ErrorKind, type[Exception]] = {ErrorKind.INVALID_REQUEST: ValueError, ErrorKind.STOPPED: Stopped}
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
        raised = RAISED.get(self.kind)
        return raised(self.message) if raised else EngineError(self.message, kind=self.kind)


Message = Started | Progress | Compiled | Done | Failed
