"""The Compare panel: one prompt at one size along up to three axes, its count and estimated time shown before it
starts, made as a grid (engine/grid.py) whose cells join the history, stoppable, found again after a reload; and
the saving of a grid that the /grid API shares."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gradio as gr

from neuron_ui.contract.grid import AXIS_HELP, DEFAULT_MAX_CELLS, GridPlan, estimate_seconds
from neuron_ui.engine.grid import build_plan, run_grid
from neuron_ui.ui import session as sessions
from neuron_ui.ui.history import HistoryEntry, gallery_items, merge_history
from neuron_ui.ui.session_events import HISTORY_SIZE
from neuron_ui.ui.styles import describe_style
from neuron_ui.ui.visitors import current_visitor
from neuron_ui.ui.words import REFRESH_SECONDS, describe_result
from neuron_ui.web.errors import user_errors
from neuron_ui.web.gradio_bridge import current_event
from neuron_ui.web.progress import ProgressReporter

if TYPE_CHECKING:
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.contract.grid_sheet import CellResult, GridResult
    from neuron_ui.contract.stopping import SessionStops
    from neuron_ui.web.files import ImageStore

AXIS_KINDS = tuple(AXIS_HELP)  # the /grid API takes them in this order, after prompt and resolution
NO_AXIS = "—"
MAX_BOARD = sessions.MAX_SESSIONS


def axis_values(*pairs: str | None) -> dict[str, str]:
    """The panel's (kind, values) pairs as plan_grid's keywords; a kind chosen twice is one line."""
    axes: dict[str, str] = {}
    for kind, values in zip(pairs[::2], pairs[1::2]):
        if not kind or kind == NO_AXIS:
            continue
        if kind not in AXIS_KINDS:
            raise ValueError(f"axis {kind!r} is not one of {', '.join(AXIS_KINDS)}")
        if kind in axes:
            raise ValueError(f"{kind} is chosen for two axes: pick each kind once")
        axes[kind] = values or ""
    return axes


def describe_plan(plan: GridPlan, seconds: float | None) -> str:
    """Before it starts: how many images, along what, about how long (an estimate), how often styles switch."""
    shape = " x ".join(f"{len(a.values)} {a.name}" for a in plan.axes)
    about = "time unknown until an image is made here" if seconds is None else f"about {seconds:.0f} s (an estimate)"
    switches = plan.switches()
    styles = f" · the style switches {switches} time{'s' if switches != 1 else ''}" if switches else ""
    return f"**{len(plan.cells)} images** ({shape}) at {plan.resolution} · {about}{styles}"


def describe_grid(grid: GridResult) -> str:
    """The line under the grid once it is made (or stopped)."""
    made, total = len(grid.made), len(grid.plan.cells)
    switches = len(grid.style_switches)
    head = f"**Stopped** after {made} of {total} images" if grid.stopped else f"**Grid** of {total} images"
    return (f"{head} at {grid.plan.resolution} · {grid.seconds:.1f} s · {switches} style switch"
            f"{'es' if switches != 1 else ''} · each image is in the history; click one to make it again")


def cell_entry(done: CellResult, path: str, show_guidance: bool) -> HistoryEntry:
    result = done.result
    return HistoryEntry(path=path, info=describe_result(result, show_guidance) + describe_style(result)
                        + f" · grid cell {done.cell.index + 1}", prompt=result.prompt, resolution=result.resolution,
                        seed=result.seed, steps=result.steps, guidance=result.guidance, lora=result.lora,
                        lora_scale=result.lora_scale, cache_event=result.cache_event, made=time.time())


class GridSaver:
    """Saves each cell as it is made (once: a repeated cell shares the file), then the sheet; `on_entry` hears
    each new history entry (the page's session holds it for a reload)."""

    def __init__(self, store: ImageStore, show_guidance: bool = False,
                 on_entry: Callable[[HistoryEntry], None] | None = None):
        self.store, self.show_guidance, self.on_entry = store, show_guidance, on_entry
        self.paths: dict[int, str] = {}
        self.entries: list[HistoryEntry] = []

    def __call__(self, done: CellResult) -> None:
        if done.same_as is not None:
            self.paths[done.cell.index] = self.paths[done.same_as]
            return
        path = self.paths[done.cell.index] = self.store.save(done.result)
        entry = cell_entry(done, path, self.show_guidance)
        self.entries.insert(0, entry)
        if self.on_entry is not None:
            self.on_entry(entry)

    def finish(self, grid: GridResult) -> tuple[str, dict[str, Any]]:
        return self.store.save(grid), grid.info(self.paths)


class GridBoard:
    """Each browser session's latest grid, for a reload: running (its plan's line) or done (the sheet, its line).
    Bounded: the oldest sessions go first."""

    def __init__(self, size: int = MAX_BOARD):
        self.size = size
        self._lock = threading.Lock()
        self._grids: OrderedDict[str, tuple[bool, str | None, str]] = OrderedDict()

    def put(self, sid: str | None, running: bool, sheet: str | None, line: str) -> None:
        if not sid:
            return
        with self._lock:
            self._grids.pop(sid, None)
            self._grids[sid] = (running, sheet, line)
            while len(self._grids) > self.size:
                self._grids.popitem(last=False)

    def get(self, sid: str | None) -> tuple[bool, str | None, str] | None:
        with self._lock:
            return self._grids.get(sid) if sid else None


class CompareHandlers:
    """The panel's events: the plan line, the grid, its restore after a reload."""

    def __init__(self, engine: EngineLike, store: ImageStore, held: sessions.HeldResults, stops: SessionStops,
                 max_cells: int = DEFAULT_MAX_CELLS, show_guidance: bool = False, board: GridBoard | None = None):
        self.engine, self.store, self.held, self.stops = engine, store, held, stops
        self.max_cells, self.show_guidance = max_cells, show_guidance
        self.board = board or GridBoard()

    def plan(self, prompt: str, resolution: str, *pairs: str | None) -> GridPlan:
        return build_plan(self.engine, self.max_cells, prompt, resolution, axis_values(*pairs))

    def on_plan(self, prompt: str, resolution: str, *pairs: str | None) -> str:
        """The line before the click: the count and the estimated time, or what is wrong, in one line."""
        if not any(kind and kind != NO_AXIS for kind in pairs[::2]):
            return "Pick an axis (seeds, styles, strengths, steps or prompts) and its values."
        try:
            plan = self.plan(prompt, resolution, *pairs)
        except ValueError as error:
            return f"**Not yet:** {error}"
        return describe_plan(plan, estimate_seconds(plan, self.engine.status()))

    def on_grid(self, prompt: str, resolution: str, kind1: str, values1: str, kind2: str, values2: str, kind3: str,
                values3: str, history: list[HistoryEntry], session: Any = None,
                progress: gr.Progress = gr.Progress()):
        """The grid from the panel: the sheet, its line, and every cell in the history."""
        sid = sessions.session_id(session)
        with user_errors():  # bad axes: one line before anything runs
            plan = self.plan(prompt, resolution, kind1, values1, kind2, values2, kind3, values3)
        what = f"grid of {len(plan.cells)} at {plan.resolution}"
        self.board.put(sid, True, None, f"*Your {what} is still being made; it shows here when it is done.*")

        # Each cell is held for the session as it is made: a page reloaded meanwhile gets them with the sheet (on_poll).
        saver = GridSaver(self.store, self.show_guidance, lambda entry: self.held.hold(sid, entry))
        self.held.begin(sid)
        try:
            with (user_errors(), ProgressReporter(progress) as reporter,
                  self.stops.track(*current_event(), on_admitted=lambda: self.held.start(sid, plan.resolution))
                  as stop):
                grid = run_grid(self.engine, plan, progress=reporter, stop=stop, visitor=current_visitor(session),
                                on_cell=saver)
                sheet, _ = saver.finish(grid)
        except gr.Error as error:
            self.held.fail(sid, error.message)
            self.board.put(sid, False, None, f"**Not made:** {error.message}")
            raise
        finally:
            self.held.end(sid)
        line = describe_grid(grid)
        self.board.put(sid, False, sheet, line)
        history = merge_history(history, saver.entries, HISTORY_SIZE)
        return sheet, line, history, gallery_items(history)

    def on_restore(self, session: Any):
        """On page load: the session's latest grid (or that it is still being made, with the poll timer on)."""
        found = self.board.get(sessions.session_id(session))
        if found is None:
            return gr.skip(), gr.skip(), gr.Timer(active=False)
        running, sheet, line = found
        shown = sheet if sheet and Path(sheet).is_file() else gr.skip()  # the image store keeps the newest 512 files
        return shown, line, gr.Timer(active=running)

    def on_poll(self, session: Any, history: list[HistoryEntry]):
        """While a grid runs that this page did not start (a reload) or stopped: once it is done, its sheet and line
        show, the cells it made join the history, and the timer stops."""
        sid = sessions.session_id(session)
        found = self.board.get(sid)
        if found is not None and found[0]:
            return (gr.skip(),) * 5
        image, line, timer = self.on_restore(session)
        history = merge_history(history, [e for e in self.held.results(sid) if Path(e.path).is_file()], HISTORY_SIZE)
        return image, line, history, gallery_items(history), timer


def add_compare_panel(styles: list[str]) -> dict[str, Any]:
    """The panel's widgets (inside the form's column); the prompt and size are the form's own."""
    parts: dict[str, Any] = {}
    with gr.Accordion("Compare: a grid", open=False, elem_id="compare"):
        gr.Markdown("The prompt and size above, along up to three axes: "
                    f"styles here: none{', ' + ', '.join(styles) if styles else ''}.", elem_id="compare-help")
        for n in (1, 2, 3):
            with gr.Row(equal_height=True):
                parts[f"kind{n}"] = gr.Dropdown([NO_AXIS, *AXIS_KINDS], value=NO_AXIS, label=f"Axis {n}", scale=1,
                                                min_width=110, elem_id=f"grid-kind{n}")
                parts[f"values{n}"] = gr.Textbox(label="values", placeholder="3+4", scale=3,
                                                 elem_id=f"grid-values{n}")
        parts["plan"] = gr.Markdown(elem_id="grid-plan")
        with gr.Row():
            parts["make"] = gr.Button("Make grid", variant="primary", elem_id="grid-make")
            parts["stop"] = gr.Button("Stop", variant="stop", elem_id="grid-stop")
        parts["image"] = gr.Image(label="Grid", type="filepath", format="png", interactive=False,
                                  buttons=["download", "fullscreen"], elem_id="grid-image")
        parts["line"] = gr.Markdown(elem_id="grid-line")
        parts["timer"] = gr.Timer(REFRESH_SECONDS, active=False)
    return parts


def wire_compare(handlers: CompareHandlers, parts: dict[str, Any], form: list[Any], history: Any, gallery: Any,
                 session: Any, demo: gr.Blocks, on_stop: Callable[..., Any], on_device: dict[str, Any],
                 hidden: dict[str, Any]) -> Any:
    """The panel's events; returns the grid's event (the form's Stop cancels it too). `form`: prompt, resolution."""
    axes = [parts[f"{part}{n}"] for n in (1, 2, 3) for part in ("kind", "values")]
    gr.on([c.change for c in (*form, *axes)], handlers.on_plan, [*form, *axes], parts["plan"],
          trigger_mode="always_last", **hidden)
    for n in (1, 2, 3):
        parts[f"kind{n}"].change(lambda kind: gr.Textbox(placeholder=AXIS_HELP.get(kind, "")), parts[f"kind{n}"],
                                 parts[f"values{n}"], **hidden)
    made = parts["make"].click(handlers.on_grid, [*form, *axes, history, session],
                               [parts["image"], parts["line"], history, gallery], show_progress_on=[parts["image"]],
                               api_visibility="private", **on_device)
    parts["stop"].click(on_stop, None, None, cancels=[made], **{**hidden, "queue": True, "concurrency_limit": None})
    # A Stop cancels the event before its handler ends: the poll shows the sheet of the cells made, once it is saved.
    made.failure(lambda: gr.Timer(active=True), None, parts["timer"], **hidden)
    demo.load(handlers.on_restore, [session], [parts["image"], parts["line"], parts["timer"]], **hidden)
    parts["timer"].tick(handlers.on_poll, [session, history],
                        [parts["image"], parts["line"], history, gallery, parts["timer"]], **hidden)
    return made


def add_grid_api(api_grid: Callable[..., Any], on_device: dict[str, Any]) -> None:
    """/grid for gradio_client: prompt, resolution, seeds, styles, strengths, steps, prompts -> (grid_png, info)."""
    with gr.Column(visible=False):
        inputs = [gr.Textbox(label=name) for name in ("prompt", "resolution", *AXIS_KINDS)]
        outputs = [gr.Image(label="grid_png", type="filepath", format="png"), gr.JSON(label="info")]
        trigger = gr.Button()
    trigger.click(api_grid, inputs, outputs, api_name="grid", preprocess=False, **on_device)
