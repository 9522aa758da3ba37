"""Making grids (and A/Bs, two-cell grids). `run_grid` makes one in the caller's thread, its cells one at a time
through the engine interface's generate, so each cell takes its turn on the device like any other image (other
visitors' images come between them) and a grid never has more than one request in the engine (it counts as one
against --max-queue and the per-visitor cap). Typed on EngineLike: the same in this process, under torchrun and
with replicas.

Grids that outlive their page: each visitor's grid runs as a job on a thread of its own (run_grid), which the
pages of that visitor only watch, so a reload finds it again and a page's Stop ends it, while a page that goes away
(its event stream closed: the gate's page-gone rule) leaves it running.

Bounded: one grid per visitor (a second is refused in one line while the first runs), at most `max_running` grids at
once on the server, each of at most --max-grid-cells cells; a finished grid is kept for its visitor's pages for
`keep_seconds` after it ends (its cells are in the history and the image store either way), at most `max_kept` of
them. No Gradio here: the UI hands in what a finished grid becomes (its saved sheet and line) as `finish`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Generic, TypeVar

from neuron_ui.contract.errors import EngineError, ErrorKind
from neuron_ui.contract.registry import BoundedRegistry
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.stopping import Phase, StopReason, StopToken
from neuron_ui.studio.grid_sheet import CellResult, GridResult, cell_size

if TYPE_CHECKING:
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.contract.results import ProgressFn, ProgressUpdate
    from neuron_ui.studio.grid_plan import GridCell, GridPlan

logger = logging.getLogger(__name__)

R = TypeVar("R")
KEEP_SECONDS = 600.0  # as long as a browser session's held results (ui/session.py HOLD_SECONDS)
MAX_KEPT = 1024  # finished grids kept at once (as many as held browser sessions)


def run_grid(engine: EngineLike, plan: GridPlan, *, progress: ProgressFn | None = None, stop: StopToken | None = None,
             visitor: str | None = None, on_cell: Callable[[CellResult], None] | None = None) -> GridResult:
    """The plan's cells in its run order (styles switched the fewest times), each told to `on_cell` when made, at
    full size (the store saves it, the CLI writes it, the UI's history hears it), then kept at the sheet's size
    (CellResult says why). A Stop, or the server shutting down (SIGTERM), ends the rest: the grid comes
    back with the cells made and `stopped` saying so (the error is raised only when no cell was made). A cell with
    the same request as an earlier one reuses its image (a repeat is told as kept)."""
    stop = stop or StopToken()
    grid = GridResult(plan)
    size = cell_size(plan.resolution)
    start = time.perf_counter()
    made: dict[tuple[object, ...], CellResult] = {}
    previous: GridCell | None = None
    total = len(plan.cells)
    for number, cell in enumerate(plan.in_order(), 1):
        key = (cell.prompt, cell.seed, cell.steps, cell.style, cell.strength)
        if key in made:
            done = CellResult(cell, made[key].result, same_as=made[key].cell.index)
        else:
            if stop.stopped:
                grid.stopped = f"stopped: {number - 1} of {total} images made"
                break
            request = GenerateRequest(cell.prompt, plan.resolution, cell.steps, cell.seed, lora=cell.style,
                                      lora_scale=cell.strength, visitor=visitor)
            told = None if progress is None else _told(progress, number, total)
            try:
                result = engine.generate(request, progress=told, stop=stop)
            except EngineError as error:  # a Stop, or a SIGTERM's drain: the sheet of the cells made
                if not grid.made or error.kind not in (ErrorKind.STOPPED, ErrorKind.SHUTTING_DOWN):
                    raise
                grid.stopped = f"{error}; {len(grid.made)} of {total} images made"
                break
            if previous is not None and previous.look != cell.look:
                grid.style_switches.append({"before_cell": cell.index,
                                            "from": {"style": previous.style, "strength": previous.strength},
                                            "to": {"style": cell.style, "strength": cell.strength}})
            previous = cell
            done = CellResult(cell, result)
            del result  # held by `done` alone: kept at the sheet's size below, not until the next cell is made
        if on_cell is not None:
            on_cell(done)
        if done.same_as is None:
            done = made[key] = done.for_sheet(size)  # the full image goes once it has been told
        grid.made.append(done)
    grid.seconds = time.perf_counter() - start
    logger.info("grid of %d at %s: %d made, %d style switches, %.1f s", total, plan.resolution, len(grid.made),
                len(grid.style_switches), grid.seconds)
    return grid


def _told(progress: ProgressFn, number: int, total: int) -> ProgressFn:
    """A cell's progress as the grid's: "image 2 of 4: ..." and the fraction of the whole grid."""

    def tell(update: ProgressUpdate) -> None:
        fraction = None if update.fraction is None else (number - 1 + update.fraction) / total
        progress(replace(update, message=f"image {number} of {total}: {update.message}", fraction=fraction))

    return tell


class GridJob(Generic[R]):
    """One visitor's grid as it runs: its cells made, its latest progress, and once ended what `finish` made of it
    (`outcome`) or the error that ended it (`failure`)."""

    def __init__(self, owner: str, plan: GridPlan):
        self.owner, self.plan = owner, plan
        self.total = len(plan.cells)
        self.made = 0
        self.outcome: R | None = None
        self.failure: Exception | None = None
        self.ended: float | None = None  # the jobs' clock when it ended
        self.since: float | None = None  # the jobs' clock when it started, then when its last cell was made
        self._token = StopToken()
        self._update: ProgressUpdate | None = None
        self._version = 0  # counts every change a watcher may show
        self._changed = threading.Condition()

    @property
    def running(self) -> bool:
        return self.ended is None

    def stop(self, reason: StopReason = StopReason.STOPPED_BY_USER) -> Phase:
        """End the rest of the grid (the cell on the device stops at its next step); the phase it was in."""
        return self._token.stop(reason)

    def follow(self, progress: ProgressFn | None, page: StopToken) -> bool:
        """Tell `progress` the grid's latest update, then each new one, until the grid ends (True). The watching
        page's token: stopped by its Stop or a cancel, it stops the grid and follows it to its end; stopped because
        the page went away (StopReason.DISCONNECTED), it leaves the grid running and returns False at once."""
        remove = page.listen(self._wake)
        seen = -1
        try:
            while True:
                with self._changed:  # until a change, the end, or the page's stop to pass on to the grid
                    while self._version == seen and self.running and (self._token.stopped or not page.stopped):
                        self._changed.wait()
                    seen, update, running = self._version, self._update, self.running
                if page.stopped and page.reason is StopReason.DISCONNECTED:
                    return not running
                if page.stopped and not self._token.stopped:
                    self.stop(page.reason or StopReason.STOPPED_BY_USER)
                if not running:
                    return True
                if update is not None and progress is not None:
                    progress(update)
        finally:
            remove()

    def wait(self, timeout: float | None = None) -> bool:
        """Until the grid ends (True) or `timeout` seconds pass."""
        with self._changed:
            return self._changed.wait_for(lambda: not self.running, timeout)

    def run(self, engine: EngineLike, finish: Callable[[GridResult], R],
            on_cell: Callable[[CellResult], None] | None, clock: Callable[[], float]) -> None:
        """The grid, in this thread (GridJobs starts one per job), then `finish`; an error is kept for the pages."""
        def made(done: CellResult) -> None:
            if on_cell is not None:
                on_cell(done)
            self._change(made=self.made + 1, since=clock())

        self._change(since=clock())
        try:
            grid = run_grid(engine, self.plan, progress=lambda update: self._change(_update=update),
                            stop=self._token, visitor=self.owner, on_cell=made)
            self._change(outcome=finish(grid), ended=clock())
        except Exception as error:  # the watching pages say it in one line (ui: user_errors)
            if not isinstance(error, (ValueError, EngineError)):
                logger.exception("a grid failed unexpectedly")
            self._change(failure=error, ended=clock())

    def _change(self, **values: object) -> None:
        """Set what a watcher may show (only this job's thread writes it), and wake the watchers."""
        with self._changed:
            for name, value in values.items():
                setattr(self, name, value)
            self._version += 1
            self._changed.notify_all()

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


class GridJobs(Generic[R]):
    """The grids of all visitors, one per visitor, by the visitor's name (web/visitors.py: a login, else a browser's
    signed session id), so only that visitor's pages find it. See the module docstring for the bounds."""

    def __init__(self, engine: EngineLike, max_running: int, keep_seconds: float = KEEP_SECONDS,
                 max_kept: int = MAX_KEPT, clock: Callable[[], float] = time.monotonic):
        self.engine, self.max_running, self.keep_seconds, self.max_kept = engine, max_running, keep_seconds, max_kept
        self.clock = clock
        # the least recently started first; _expire keeps it under its size, so a running grid is never dropped
        self._jobs: BoundedRegistry[str, GridJob[R]] = BoundedRegistry(max_kept + max_running)
        self._lock = threading.Lock()

    def start(self, owner: str, plan: GridPlan, finish: Callable[[GridResult], R],
              on_cell: Callable[[CellResult], None] | None = None) -> GridJob[R]:
        """Start `owner`'s grid on a thread of its own; ValueError in one line while one of theirs runs, or while
        `max_running` grids run."""
        with self._lock:
            self._expire()
            mine = self._jobs.get(owner)
            if mine is not None and mine.running:
                raise ValueError(f"your grid of {mine.total} at {mine.plan.resolution} is still being made "
                                 f"({mine.made} done): stop it, or wait for it to finish")
            running = len(self._running())
            if running >= self.max_running:
                raise ValueError(f"{running} grids are being made on this server, its limit: try again when one "
                                 "is done")
            job: GridJob[R] = GridJob(owner, plan)
            self._jobs[owner] = job
        threading.Thread(target=job.run, args=(self.engine, finish, on_cell, self.clock), name="grid",
                         daemon=True).start()
        return job

    def find(self, owner: str | None) -> GridJob[R] | None:
        """`owner`'s grid: running, or ended less than keep_seconds ago."""
        with self._lock:
            self._expire()
            return self._jobs.get(owner) if owner else None

    def stop(self, owner: str | None) -> Phase | None:
        """End the rest of `owner`'s running grid; None when none runs."""
        job = self.find(owner)
        return job.stop() if job is not None and job.running else None

    def running(self) -> int:
        """How many grids are being made now."""
        with self._lock:
            return len(self._running())

    def wait(self, timeout: float) -> bool:
        """Until every grid being made now has ended, its sheet saved (`finish` has run), or `timeout` seconds pass;
        True if all ended. The server's drain (SIGTERM): the engine refuses each grid's next cell, so each ends with the
        sheet of its cells made, as a Stop's, but in its own thread, which the process's exit would cut short."""
        deadline = time.monotonic() + timeout
        with self._lock:
            running = self._running()
        return all(job.wait(max(deadline - time.monotonic(), 0.0)) for job in running)

    def _running(self) -> list[GridJob[R]]:
        return [job for job in self._jobs.values() if job.running]

    def _expire(self) -> None:
        """Drop grids ended keep_seconds ago, then the longest-ended past max_kept; a running grid is never dropped
        (it is bounded by max_running and its cells)."""
        deadline = self.clock() - self.keep_seconds
        for when, owner in sorted((job.ended, owner) for owner, job in self._jobs.items() if job.ended is not None):
            if when < deadline or len(self._jobs) > self.max_kept:
                self._jobs.pop(owner)
