"""What makes images behind the engine's front: the pipeline on this process's device (engine.local.LocalRunner) or
a Ray Serve replica (replicas.runner.ReplicaRunner). The front (engine.engine.Engine) is the same for both: it checks
a request's layout, gives the device its turns, tells the waiting, keeps the warm-up list and the status."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from neuron_ui.contract.engine_like import Health, Observers
    from neuron_ui.contract.layouts import Layout, Layouts
    from neuron_ui.contract.requests import GenerateRequest
    from neuron_ui.contract.results import EngineStatus, GenerateResult, ProgressFn, ShapeStatus
    from neuron_ui.contract.stopping import StopToken
    from neuron_ui.engine.waiting import DeviceWatch

Job = TypeVar("Job")  # a request as the runner runs it, from prepare() to make()


class DeviceRunner(Protocol[Job]):
    """The device side of an engine. `slots`: images it makes at once (the front's queue lets that many through);
    `allowed`: the layouts it makes; `observers`: told of its compiles (the front tells them of images and failures).
    Errors: ValueError for bad input, EngineError (one line) for failures."""

    slots: int
    allowed: Layouts
    observers: Observers

    def prepare(self, request: GenerateRequest, layout: Layout) -> Job:
        """Before the queue: what make() runs (every field checked: ValueError names what is allowed)."""

    def make(self, job: Job, layout: Layout, report: ProgressFn, stop: StopToken, watch: DeviceWatch) -> GenerateResult:
        """In its turn: the image of a prepared request, compiling its layout first where needed; `watch` hears what
        holds the device, for the users waiting behind it."""

    def warm(self, layout: Layout, report: ProgressFn, watch: DeviceWatch) -> None:
        """In its turn: compile a layout without making an image."""

    def compile_left(self, layout: Layout) -> float | None:
        """Seconds a request at `layout` would compile before its image: 0.0 when held, None when unknown."""

    def shape(self, layout: Layout, warmup: list[Layout]) -> ShapeStatus:
        """One layout's state (`warmup`: the layouts still to warm up)."""

    def used(self) -> list[Layout]:
        """The editing layouts used or warmed up, for the status's layouts section."""

    def status(self) -> EngineStatus:
        """The runner's part of the status (facts, cache, tensor parallelism, styles, replicas); the front fills in
        its queue, warm-up list and sizes."""

    def prompt_tokens(self, text: str) -> tuple[int, int]: ...

    def health(self) -> Health: ...

    def close(self) -> None:
        """Shutting down: what waits beyond the front's queue hears so (a replica's router); nothing new starts."""
