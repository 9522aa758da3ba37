"""The engine's status snapshot, for the UI's table and /status: assembled from its parts, never waiting for the
device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from neuron_ui.contract.layouts import Layout
from neuron_ui.contract.results import EngineStatus

if TYPE_CHECKING:
    from neuron_ui.config.resolutions import Resolution
    from neuron_ui.engine.device_queue import DeviceQueue
    from neuron_ui.engine.graphs import GraphBook


@dataclass(frozen=True)
class EngineFacts:
    """What the status says that never changes while the engine serves."""

    model: str
    device: str
    dtype: str
    compile_mode: str
    compile_backend: str
    is_tiny: bool
    fallback_reason: str | None
    distilled: bool
    default_steps: int
    default_guidance: float
    cache_dir: str
    presets: tuple[Resolution, ...]
    reference_sizes: tuple[Resolution, ...]
    max_references: int


def assemble_status(facts: EngineFacts, graphs: GraphBook, queue: DeviceQueue, warmup: list[Resolution], *,
                    persistent_cache: bool, cache_error: str | None, tensor_parallel: dict[str, Any] | None,
                    styles: list[dict[str, Any]]) -> EngineStatus:
    """The facts, every preset's and used layout's state, the device's queue and what is left to warm up."""
    shapes = [graphs.status(Layout(preset), warmup) for preset in facts.presets]
    return EngineStatus(
        model=facts.model, device=facts.device, dtype=facts.dtype, compile_mode=facts.compile_mode,
        compile_backend=facts.compile_backend, is_tiny=facts.is_tiny, fallback_reason=facts.fallback_reason,
        distilled=facts.distilled, default_steps=facts.default_steps, default_guidance=facts.default_guidance,
        cache_dir=facts.cache_dir, persistent_cache=persistent_cache, cache_error=cache_error,
        busy=queue.busy,
        tensor_parallel=tensor_parallel,
        queue_depth=queue.waiting, visitors_waiting=queue.visitors_waiting,
        warmup_queue=[str(p) for p in warmup],
        warmup_seconds_left=round(sum(s.estimate_seconds or 0.0 for s in shapes if s.warmup_queued), 1),
        shapes=shapes,
        layouts=[graphs.status(layout, warmup) for layout in graphs.used()],
        reference_sizes=[str(r) for r in facts.reference_sizes],
        max_references=facts.max_references,
        styles=styles,
    )
