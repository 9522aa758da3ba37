"""Making an A/B: its two images as a two-cell grid through the grid's runner (engine/grid.py), so each takes its
turn on the device like any other image and the pair is one request in the engine (one against --max-queue and the
per-visitor cap). Typed on EngineLike: the same in this process, under torchrun and with replicas."""

from __future__ import annotations

from typing import TYPE_CHECKING

from neuron_ui.contract.ab import plan_ab
from neuron_ui.contract.ab_sheet import ABResult
from neuron_ui.engine.grid import run_grid

if TYPE_CHECKING:
    from collections.abc import Callable

    from neuron_ui.contract.ab import ABPlan
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.contract.grid_sheet import CellResult
    from neuron_ui.contract.results import ProgressFn
    from neuron_ui.contract.stopping import StopToken


def build_ab(engine: EngineLike, prompt: object, resolution: object, a: object, b: object) -> ABPlan:
    """The A/B's plan against this engine's sizes, loaded styles and default steps; ValueError in one line before
    anything runs."""
    status = engine.status()
    loaded = {style["name"]: style["default_scale"] for style in status.styles}
    return plan_ab(prompt, resolution, a, b, presets=engine.presets, loaded=loaded,
                   default_steps=status.default_steps)


def run_ab(engine: EngineLike, plan: ABPlan, *, progress: ProgressFn | None = None, stop: StopToken | None = None,
           visitor: str | None = None, on_cell: Callable[[CellResult], None] | None = None) -> ABResult:
    """A, then B, each told to `on_cell` when made (the history); a Stop after A returns A alone, `stopped` saying
    so (Stopped is raised when nothing was made)."""
    grid = run_grid(engine, plan.grid, progress=progress, stop=stop, visitor=visitor, on_cell=on_cell)
    return ABResult.from_grid(grid, plan.differs)
