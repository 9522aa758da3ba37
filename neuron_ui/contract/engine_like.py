"""The seam: the engine interface the UI and the server use, and the observers it tells."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from neuron_ui.config.resolutions import Resolution
    from neuron_ui.contract.layouts import Layout
    from neuron_ui.contract.requests import GenerateRequest
    from neuron_ui.contract.results import EngineStatus, GenerateResult, ProgressFn, ShapeStatus


class EngineObserver(Protocol):
    """Told what the engine did, e.g. to count it for /metrics; the engine itself knows nothing of metrics."""

    def on_generated(self, result: GenerateResult) -> None: ...

    def on_compiled(self, resolution: str, event: str, seconds: float) -> None: ...

    def on_failed(self, kind: str) -> None: ...


class EngineLike(Protocol):
    """The one seam between the UI (and the server) and whatever makes images: neuron_ui.engine.Engine in this
    process, or neuron_ui.replicas.ReplicaClient over Ray Serve. Errors: ValueError for bad input, EngineError."""

    presets: tuple[Resolution, ...]
    max_references: int
    reference_sizes: tuple[Resolution, ...]

    def generate(self, request: GenerateRequest, progress: ProgressFn | None = None,
                 stop: Any = None) -> GenerateResult: ...  # stop: a neuron_ui.stopping.StopToken
    def inpaint(self, request: GenerateRequest, progress: ProgressFn | None = None,
                stop: Any = None) -> GenerateResult: ...
    def warmup(self, resolution: str, progress: ProgressFn | None = None) -> ShapeStatus: ...
    def prompt_tokens(self, text: str) -> tuple[int, int]: ...
    def start_warmup(self, resolutions: list[str]) -> None: ...
    def layout(self, resolution: str, references: int = 0, reference_size: str | None = None,
               inpaint: bool = False) -> Layout: ...
    def layout_status(self, layout: Layout) -> ShapeStatus: ...
    def status(self) -> EngineStatus: ...
    def drain(self, timeout: float) -> bool: ...
