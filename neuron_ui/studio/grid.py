"""Making a grid (or an A/B, a two-cell grid): its cells one at a time through the engine interface's generate,
so each cell takes its turn on the device like any other image (other visitors' images come between them) and a grid
never has more than one request in the engine (it counts as one against --max-queue and the per-visitor cap). Typed
on EngineLike: the same in this process, under torchrun and with replicas."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from neuron_ui.studio.grid_sheet import CellResult, GridResult
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.stopping import Stopped, StopToken

if TYPE_CHECKING:
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.studio.grid_plan import GridCell, GridPlan
    from neuron_ui.contract.results import ProgressFn, ProgressUpdate

logger = logging.getLogger(__name__)


def cell_request(plan: GridPlan, cell: GridCell, visitor: str | None) -> GenerateRequest:
    return GenerateRequest(cell.prompt, plan.resolution, cell.steps, cell.seed, lora=cell.style,
                           lora_scale=cell.strength, visitor=visitor)


def run_grid(engine: EngineLike, plan: GridPlan, *, progress: ProgressFn | None = None, stop: StopToken | None = None,
             visitor: str | None = None, on_cell: Callable[[CellResult], None] | None = None) -> GridResult:
    """The plan's cells in its run order (styles switched the fewest times), each told to `on_cell` when made (the
    UI's history). A Stop ends the rest: the grid comes back with the cells made and `stopped` saying so (Stopped
    is raised only when no cell was made). A cell with the same request as an earlier one reuses its image."""
    stop = stop or StopToken()
    grid = GridResult(plan)
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
            try:
                result = engine.generate(cell_request(plan, cell, visitor), progress=_told(progress, number, total),
                                         stop=stop)
            except Stopped as error:
                if not grid.made:
                    raise
                grid.stopped = f"{error}; {len(grid.made)} of {total} images made"
                break
            if previous is not None and previous.look != cell.look:
                grid.style_switches.append(_switch(previous, cell))
            previous = cell
            done = made[key] = CellResult(cell, result)
        grid.made.append(done)
        if on_cell is not None:
            on_cell(done)
    grid.seconds = time.perf_counter() - start
    logger.info("grid of %d at %s: %d made, %d style switches, %.1f s", total, plan.resolution, len(grid.made),
                len(grid.style_switches), grid.seconds)
    return grid


def _switch(before: GridCell, after: GridCell) -> dict[str, object]:
    return {"before_cell": after.index, "from": {"style": before.style, "strength": before.strength},
            "to": {"style": after.style, "strength": after.strength}}


def _told(progress: ProgressFn | None, number: int, total: int) -> ProgressFn | None:
    """A cell's progress as the grid's: "image 2 of 4: ..." and the fraction of the whole grid."""
    if progress is None:
        return None
    report: ProgressFn = progress

    def tell(update: ProgressUpdate) -> None:
        fraction = None if update.fraction is None else (number - 1 + update.fraction) / total
        report(replace(update, message=f"image {number} of {total}: {update.message}", fraction=fraction))

    return tell
