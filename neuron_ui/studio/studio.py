"""The studio: what a user asks for, made through the engine seam, whichever door asked.

`Studio` offers generate, inpaint, warmup, grid and ab (and grid jobs that outlive their page), each the same for
the page, the named API, MCP and the CLI: the door says who asks and what hears the call (`Asker`), the studio puts
the visitor on the request (visitors take turns on the device), keys its stop token to the asker's session and event
(Stop, /stop, a cancel or a disconnect find it), runs it, and saves the result in its store when it has one. A grid
or an A/B is planned against this engine's sizes and styles, then made by grid_jobs.py's run_grid. No Gradio here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from neuron_ui.contract.stopping import SessionStops, StopToken
from neuron_ui.studio.ab import ABResult, plan_ab
from neuron_ui.studio.grid_jobs import GridJob, GridJobs, run_grid
from neuron_ui.studio.grid_plan import DEFAULT_MAX_CELLS, plan_grid

if TYPE_CHECKING:
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.contract.requests import GenerateRequest
    from neuron_ui.contract.results import GenerateResult, ProgressFn, ProgressUpdate, ShapeStatus, StepPreview
    from neuron_ui.studio.ab import ABPlan
    from neuron_ui.studio.grid_plan import GridPlan, Info
    from neuron_ui.studio.grid_sheet import CellResult, GridResult

R = TypeVar("R")
DEFAULT_MAX_GRIDS = 17  # grids at once on a server: --max-queue's default + 1, as many as the device's events
PreviewSink = Callable[["StepPreview"], None]


class ResultStore(Protocol):
    """Where the studio saves what it made (web/files.py's ImageStore): the saved file's path."""

    def save(self, result: GenerateResult | GridResult) -> str: ...


@dataclass(frozen=True)
class Asker:
    """Who asks, and what hears the call: a door's part of every studio call. `session` and `event` key the call's
    stop token in the studio's SessionStops; a door with a stop of its own (MCP's cancel) passes `stop` instead.
    `on_admitted` runs once the engine has checked the request; `on_preview` hears each step's estimate."""

    visitor: str | None = None
    session: str | None = None
    event: str | None = None
    progress: ProgressFn | None = None
    on_admitted: Callable[[], None] | None = None
    on_preview: PreviewSink | None = None
    stop: StopToken | None = None

    def tell(self, update: ProgressUpdate) -> None:
        """The engine's update to what hears it: a step preview to on_preview, anything else to progress."""
        if update.preview is not None:
            if self.on_preview is not None:
                self.on_preview(update.preview)
        elif self.progress is not None:
            self.progress(update)


@dataclass(frozen=True)
class Made:
    """One image as made for its asker, and where the studio saved it (None without a store)."""

    result: GenerateResult
    path: str | None


@dataclass
class Sheet:
    """A grid or an A/B as made, with where the studio saved its sheet and each cell (by cell index)."""

    grid: GridResult
    path: str | None = None
    cells: dict[int, str] = field(default_factory=dict)

    def info(self) -> Info:
        return self.grid.info(self.cells)


class CellSaver:
    """Saves each cell as it is made, at full size (once: a repeated cell shares the file), then the sheet; `on_saved`
    hears each newly saved cell and its path (the page's history), `on_made` every cell as it is made, saved or not
    (the CLI, which has no store, writes them). The grid keeps only sheet-sized cells (run_grid): a door that wants a
    cell's image takes it here."""

    def __init__(self, store: ResultStore | None, on_saved: Callable[[CellResult, str], None] | None = None,
                 on_made: Callable[[CellResult], None] | None = None):
        self.store, self.on_saved, self.on_made = store, on_saved, on_made
        self.cells: dict[int, str] = {}

    def __call__(self, done: CellResult) -> None:
        if self.store is not None and done.same_as is not None:
            self.cells[done.cell.index] = self.cells[done.same_as]
        elif self.store is not None:
            path = self.cells[done.cell.index] = self.store.save(done.result)
            if self.on_saved is not None:
                self.on_saved(done, path)
        if self.on_made is not None:
            self.on_made(done)

    def finish(self, grid: GridResult) -> Sheet:
        return Sheet(grid, None if self.store is None else self.store.save(grid), dict(self.cells))


class Studio:
    """generate, inpaint, warmup, grid and ab over one engine, with a store to save in (None: the caller keeps the
    results: MCP sends them, the CLI writes them where it is told), the running calls by session (`stops`, shared
    with the server's gate) and the grid jobs of every visitor."""

    def __init__(self, engine: EngineLike, store: ResultStore | None = None, stops: SessionStops | None = None,
                 max_grid_cells: int = DEFAULT_MAX_CELLS, max_grids: int = DEFAULT_MAX_GRIDS):
        self.engine, self.store = engine, store
        self.stops = SessionStops() if stops is None else stops
        self.max_grid_cells = max_grid_cells  # images one grid may make
        self.jobs: GridJobs[Any] = GridJobs(engine, max_grids)  # each job's outcome is its door's (start_grid)

    def _token(self, asker: Asker) -> AbstractContextManager[StopToken]:
        if asker.stop is not None:
            return nullcontext(asker.stop)
        return self.stops.track(asker.session, asker.event, on_admitted=asker.on_admitted)

    def generate(self, request: GenerateRequest, asker: Asker = Asker()) -> Made:
        """One image, saved in the store."""
        return self._make(self.engine.generate, request, asker)

    def inpaint(self, request: GenerateRequest, asker: Asker = Asker()) -> Made:
        """Redo the masked part of the request's image (the engine refuses one without image and mask)."""
        return self._make(self.engine.inpaint, request, asker)

    def _make(self, call: Callable[..., GenerateResult], request: GenerateRequest, asker: Asker) -> Made:
        request = replace(request, visitor=asker.visitor, preview=asker.on_preview is not None)
        with self._token(asker) as stop:
            result = call(request, progress=asker.tell, stop=stop)
        return Made(result, None if self.store is None else self.store.save(result))  # a full disk: one line

    def warmup(self, resolution: str, asker: Asker = Asker()) -> ShapeStatus:
        """Compile one preset without making an image; its status."""
        return self.engine.warmup(resolution, asker.progress, visitor=asker.visitor)

    def plan_grid(self, prompt: object, resolution: object, axes: Mapping[str, object]) -> GridPlan:
        """The grid's plan against this engine's sizes and loaded styles; ValueError in one line before anything
        runs."""
        return plan_grid(prompt, resolution, presets=self.engine.presets, loaded=self._styles()[0],
                         max_cells=self.max_grid_cells, **axes)

    def plan_ab(self, prompt: object, resolution: object, a: object, b: object) -> ABPlan:
        """The A/B's plan against this engine's sizes, loaded styles and default steps; ValueError in one line."""
        loaded, default_steps = self._styles()
        return plan_ab(prompt, resolution, a, b, presets=self.engine.presets, loaded=loaded,
                       default_steps=default_steps)

    def _styles(self) -> tuple[dict[str, float], int]:
        """The loaded styles' default strengths by name, and the model's default steps."""
        status = self.engine.status()
        return {style["name"]: style["default_scale"] for style in status.styles}, status.default_steps

    def grid(self, plan: GridPlan, asker: Asker = Asker(), on_saved: Callable[[CellResult, str], None] | None = None,
             on_made: Callable[[CellResult], None] | None = None) -> Sheet:
        """The plan's cells in cost order (styles switched the fewest times), each saved as it is made (CellSaver:
        `on_saved`, `on_made`); a Stop ends the rest (the sheet says so)."""
        return self._sheet(plan, asker, CellSaver(self.store, on_saved, on_made))

    def ab(self, plan: ABPlan, asker: Asker = Asker(), on_made: Callable[[CellResult], None] | None = None) -> Sheet:
        """A, then B, as a two-cell grid (one request); a Stop after A returns A alone, `stopped` saying so."""
        return self._sheet(plan.grid, asker, CellSaver(self.store, on_made=on_made),
                           lambda grid: ABResult(**vars(grid), differs=plan.differs))

    def _sheet(self, plan: GridPlan, asker: Asker, saver: CellSaver,
               sheet: Callable[[GridResult], GridResult] = lambda grid: grid) -> Sheet:
        with self._token(asker) as stop:
            grid = run_grid(self.engine, plan, progress=asker.progress, stop=stop, visitor=asker.visitor,
                            on_cell=saver)
        return saver.finish(sheet(grid))

    def start_grid(self, owner: str, plan: GridPlan, finish: Callable[[Sheet], R],
                   on_saved: Callable[[CellResult, str], None] | None = None) -> GridJob[R]:
        """`owner`'s grid as a job on a thread of its own (studio/grid_jobs.py), saved as it is made; `finish` makes
        what its pages show of the sheet. ValueError in one line while one of theirs runs, or too many do."""
        saver = CellSaver(self.store, on_saved)
        return self.jobs.start(owner, plan, lambda grid: finish(saver.finish(grid)), saver)
