"""The two ways to compare images.

The Compare panel: one prompt at one size along up to three axes, its count and estimated time shown before it
starts, made as a grid that runs as its visitor's job in the studio (studio/grid_jobs.py) and outlives the page: the
page only watches it, a reload (or another tab of the same visitor) finds it still running, any of that visitor's
pages can stop it; its cells join the history.

A/B: the image shown against any image of the history, in Gradio's ImageSlider (InvokeAI's compare view).
*Compare (A/B)* under the image opens the slider with the image shown on the left (A) and the image made before it on
the right (B); while it is open, a click on the history puts that image on the right (and restores it, as a click
always does); *Close* goes back to the image alone. Only paths of the session's history reach the slider.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import gradio as gr

from neuron_ui.studio.grid_plan import AXIS_HELP, GridPlan, estimate_seconds
# at run time, not only for the type checker: Gradio reads the handlers' hints
from neuron_ui.ui.history import HistoryEntry, entry_named, gallery_items, merge_history, picked
from neuron_ui.ui.styles import describe_style
from neuron_ui.ui.session import HISTORY_SIZE, BrowserSession, HeldResults, current_visitor, session_id
from neuron_ui.ui.words import REFRESH_SECONDS, describe_result
from neuron_ui.web.errors import user_errors
from neuron_ui.web.files import page_script
from neuron_ui.web.gradio_bridge import HIDDEN, TOLD, Listen, current_event
from neuron_ui.web.progress import ProgressReporter

if TYPE_CHECKING:
    from gradio.events import Dependency

    from neuron_ui.studio.grid_jobs import GridJob
    from neuron_ui.studio.grid_sheet import CellResult, GridResult
    from neuron_ui.studio.studio import Sheet, Studio

AXIS_KINDS = tuple(AXIS_HELP)  # the /grid API takes them in this order, after prompt and resolution
NO_AXIS = "—"


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


@dataclass(frozen=True)
class GridShown:
    """What a finished grid shows on its visitor's pages: the saved sheet, its line, the cells' history entries."""

    sheet: str
    line: str
    entries: list[HistoryEntry]


def describe_running(job: GridJob[GridShown], seconds: float | None, now: float) -> str:
    """The grid's line on a page that did not start it (a reload): how far it is, and about how long is left
    (`seconds`: the whole grid's estimate; `now`: the jobs' clock), counting down within a cell too: the image being
    made has its share less the time since the last one was made (never below nothing)."""
    left = None
    if seconds is not None:
        share, waiting = seconds / job.total, job.total - job.made
        elapsed = 0.0 if job.since is None else max(now - job.since, 0.0)
        left = share * max(waiting - 1, 0) + (max(share - elapsed, 0.0) if waiting else 0.0)
    left_words = "time left unknown until an image is made here" if left is None else \
        f"about {left:.0f} s left (an estimate)" if left >= 1 else "under a second left (an estimate)"
    return (f"*Your grid of {job.total} images at {job.plan.resolution} is still being made (asked for before this "
            f"page loaded): {job.made} of {job.total} made · {left_words}; it shows here when it is done.*")


class CompareHandlers:
    """The panel's events: they start a visitor's grid, watch it (from any of that visitor's pages) and stop it; the
    grid is a job outside any page's event, which a page going away leaves running (the module's docstring)."""

    def __init__(self, studio: Studio, held: HeldResults, show_guidance: bool = False):
        self.studio, self.engine, self.held, self.stops = studio, studio.engine, held, studio.stops
        self.jobs, self.show_guidance = studio.jobs, show_guidance

    def on_plan(self, prompt: str, resolution: str, *pairs: str | None) -> str:
        """The line before the click: the count and the estimated time, or what is wrong, in one line."""
        if not any(kind and kind != NO_AXIS for kind in pairs[::2]):
            return "Pick an axis (seeds, styles, strengths, steps or prompts) and its values."
        try:
            plan = self.studio.plan_grid(prompt, resolution, axis_values(*pairs))
        except ValueError as error:
            return f"**Not yet:** {error}"
        return describe_plan(plan, estimate_seconds(plan, self.engine.status()))

    def on_grid(self, prompt: str, resolution: str, kind1: str, values1: str, kind2: str, values2: str, kind3: str,
                values3: str, session: BrowserSession | None = None, progress: gr.Progress = gr.Progress()):
        """The grid from the panel, started as this visitor's job and watched: the sheet and its line (on_cells
        then puts every cell in the history). Bad axes, or a grid of theirs still running: one line."""
        sid = session_id(session)
        entries: list[HistoryEntry] = []

        def saved(done: CellResult, path: str) -> None:
            # Each cell is held for the browser session too: its other pages' history finds them (SessionEvents).
            words = describe_result(done.result, self.show_guidance) + describe_style(done.result)
            entry = HistoryEntry.made_from(done.result, path, f"{words} · grid cell {done.cell.index + 1}")
            entries.insert(0, entry)
            self.held.hold(sid, entry)

        def finish(sheet: Sheet) -> GridShown:
            """In the job's thread, once the grid ends and its sheet is saved (the cells already are)."""
            return GridShown(str(sheet.path), describe_grid(sheet.grid), list(entries))

        with user_errors():
            axes = axis_values(kind1, values1, kind2, values2, kind3, values3)
            plan = self.studio.plan_grid(prompt, resolution, axes)
            job = self.studio.start_grid(owner(session), plan, finish, saved)
        return self._watch(job, progress)

    def on_watch(self, session: BrowserSession | None, progress: gr.Progress = gr.Progress()):
        """After every page load: while the visitor's grid runs (a reload, another tab), its progress, then its
        sheet, and that it followed it (on_cells then adds its cells); nothing when none runs."""
        job = self.jobs.find(owner(session))
        if job is None or not job.running:
            return gr.skip(), gr.skip(), gr.skip()
        return (*self._watch(job, progress), True)

    def _watch(self, job: GridJob[GridShown], progress: gr.Progress):
        """Follow the job until it ends; this page's Stop or cancel stops it, this page going away does not."""
        with user_errors(), ProgressReporter(progress) as reporter, self.stops.track(*current_event()) as page:
            if not job.follow(reporter, page):
                return gr.skip(), gr.skip()  # the page went away: no one reads this
            if job.failure is not None:
                raise job.failure
        shown = job.outcome
        return (shown.sheet, shown.line) if shown is not None else (gr.skip(), gr.skip())

    def on_cells(self, session: BrowserSession | None, history: list[HistoryEntry], followed: bool = True):
        """After a watch that `followed` the grid to its end: its cells join the history as it is now."""
        job = self.jobs.find(owner(session))
        if not followed or job is None or job.outcome is None:
            return gr.skip(), gr.skip()
        history = merge_history(history, [e for e in job.outcome.entries if Path(e.path).is_file()], HISTORY_SIZE)
        return history, gallery_items(history)

    def on_stop(self, session: BrowserSession | None) -> None:
        """The panel's Stop, from any page of the visitor: the rest of their grid is not made."""
        phase = self.jobs.stop(owner(session))
        gr.Info("Nothing to stop: no grid of yours is being made." if phase is None else
                "Stopping the grid: the image being made stops at its next step and the rest are not made.")

    def on_restore(self, session: BrowserSession | None):
        """On page load: the visitor's grid, still running (its line, which the line timer keeps current; on_watch
        follows) or finished (its sheet and line). Outputs: image, line, poll timer, line timer."""
        job = self.jobs.find(owner(session))
        return (*self._shown(job), gr.Timer(active=False), gr.Timer(active=job is not None and job.running))

    def on_line(self, session: BrowserSession | None):
        """The line timer's tick, active while a grid from before this page's load runs: its line follows the grid
        (how many made, the time left counting down); once it ends the timer stops (the watch shows the sheet and
        its line, then on_restore its line again, over a tick answered as the grid ended). Outputs: line, line timer."""
        job = self.jobs.find(owner(session))
        if job is None or not job.running:
            return gr.skip(), gr.Timer(active=False)
        return self._shown(job)[1], gr.skip()

    def on_poll(self, session: BrowserSession | None, history: list[HistoryEntry]):
        """After a watch failed (a cancel, a refusal while the grid runs): once the grid ends, its sheet and line
        show, its cells join the history, and the timer stops."""
        job = self.jobs.find(owner(session))
        if job is not None and job.running:
            return (gr.skip(),) * 5
        return (*self._shown(job), *self.on_cells(session, history), gr.Timer(active=False))

    def _shown(self, job: GridJob[GridShown] | None) -> tuple[object, object]:
        """The grid's image and line: nothing without one, how far it is while it runs, then its sheet (the store
        keeps the newest 512) and line, or why it was not made."""
        if job is None:
            return gr.skip(), gr.skip()
        if job.running:
            seconds = estimate_seconds(job.plan, self.engine.status())
            return gr.skip(), describe_running(job, seconds, self.jobs.clock())
        if job.outcome is None:  # the one line a page is told for the error that ended it (web/errors.py's words)
            try:
                with user_errors():
                    raise job.failure or RuntimeError("no result")
            except gr.Error as told:
                return gr.skip(), f"**Not made:** {told.message}"
        sheet = job.outcome.sheet
        return sheet if Path(sheet).is_file() else gr.skip(), job.outcome.line


def owner(session: BrowserSession | None) -> str:
    """Whose grid: the visitor of this event (a login, else the browser's signed session id; web/visitors.py)."""
    return current_visitor(session) or "anonymous"


def add_compare_panel(handlers: CompareHandlers, styles: list[str], form: list[gr.Textbox | gr.Dropdown],
                      history: gr.State, gallery: gr.Gallery, session: gr.BrowserState, demo: gr.Blocks,
                      on_device: Listen) -> tuple[Dependency, tuple[gr.Image, gr.Markdown]]:
    """The panel (inside the form's column; the prompt and size are the form's own) and its events; returns the grid's
    event (the form's Stop cancels it, which stops the grid too) and the sheet and its line, for the caller to render
    where they can be read (full width, under the form and the result). `form`: prompt, resolution; `on_device`: the
    page's private events' keywords for the device."""
    kinds, values = [], []
    with gr.Accordion("Compare: a grid", open=False, elem_id="compare"):
        gr.Markdown("The prompt and size above, along up to three axes: "
                    f"styles here: none{', ' + ', '.join(styles) if styles else ''}.", elem_id="compare-help")
        for n in (1, 2, 3):
            with gr.Row(equal_height=True):
                kinds.append(gr.Dropdown([NO_AXIS, *AXIS_KINDS], value=NO_AXIS, label=f"Axis {n}", scale=2,
                                         min_width=150, elem_id=f"grid-kind{n}"))
                values.append(gr.Textbox(label="values", placeholder="3+4", scale=3, elem_id=f"grid-values{n}"))
        plan = gr.Markdown(elem_id="grid-plan")
        with gr.Row():
            make = gr.Button("Make grid", variant="primary", elem_id="grid-make")
            stop = gr.Button("Stop", variant="stop", elem_id="grid-stop")
        # Rendered by the caller; a click on the sheet opens it full size (assets/page.js).
        image = gr.Image(label="Grid", show_label=False, type="filepath", format="png", interactive=False,
                         buttons=["download", "fullscreen"], elem_id="grid-image", render=False)
        line = gr.Markdown(elem_id="grid-line", render=False)
        timer = gr.Timer(REFRESH_SECONDS, active=False)
        line_timer = gr.Timer(REFRESH_SECONDS, active=False)  # keeps a reloaded page's line current (on_line)
    axes: list[gr.Textbox | gr.Dropdown] = [part for pair in zip(kinds, values) for part in pair]
    gr.on([c.change for c in (*form, *axes)], handlers.on_plan, [*form, *axes], plan, trigger_mode="always_last",
          **HIDDEN)
    for kind, value in zip(kinds, values):
        kind.change(lambda kind: gr.Textbox(placeholder=AXIS_HELP.get(kind, "")), kind, value, **HIDDEN)
    shown = [image, line]
    made = make.click(handlers.on_grid, [*form, *axes, session], shown, show_progress_on=[image], **on_device)
    # Every page load: the visitor's grid, and while it runs, a watch of it (queued, for its progress; not on the
    # device: it waits on the grid, which takes its turns there itself; it returns at once when nothing runs).
    loaded = demo.load(handlers.on_restore, [session], [*shown, timer, line_timer], **HIDDEN)
    followed = gr.State(False)  # whether the watch followed a grid to its end (else the history is not its to write)
    watched = loaded.then(handlers.on_watch, [session], [*shown, followed], show_progress_on=[image],
                          api_visibility="private", queue=True, concurrency_limit=None)
    # The cells join the history as it is once the grid ends (read then: images made meanwhile stay).
    made.then(handlers.on_cells, [session, history], [history, gallery], **HIDDEN)
    watched.then(handlers.on_cells, [session, history, followed], [history, gallery], **HIDDEN)
    watched.success(lambda s: handlers.on_restore(s)[1::2], [session], [line, line_timer], **HIDDEN)  # over a late tick
    for event in (made, watched):  # a cancel (the form's Stop) ends the event first: the poll shows the sheet
        event.failure(lambda: gr.Timer(active=True), None, timer, **HIDDEN)
    stop.click(handlers.on_stop, [session], None, **TOLD)
    timer.tick(handlers.on_poll, [session, history], [*shown, history, gallery, timer], **HIDDEN)
    line_timer.tick(handlers.on_line, [session], [line, line_timer], **HIDDEN)
    return made, (image, line)


SHOW_PANEL = page_script("show_panel")  # scrolls the panel into view once it opened (the file says why)
NO_IMAGE = "No image yet: generate one first, then compare it with another of the history."
ALONE = "Only one image in this session's history: make another, then compare."
EXPIRED = ("The other images of this history have expired on the server (it keeps the 512 images shown or made most "
           "recently): make another, then compare.")


def describe_pair(left: HistoryEntry | None, right: HistoryEntry) -> str:
    """Which side is which, in what differs between them."""
    def one(entry: HistoryEntry | None) -> str:
        if entry is None:
            return "the image shown"
        style = f", style {entry.lora} {entry.lora_scale:g}" if entry.lora and entry.lora_scale is not None else ""
        return f"seed {entry.seed}, {entry.resolution}, {entry.steps or 'default'} steps{style}"

    return (f"**A (left)**: {one(left)} · **B (right)**: {one(right)}. "
            "Click another image of the history to put it on the right.")


def on_ab_open(image: object, history: list[HistoryEntry]) -> tuple[object, ...]:
    """A: the image shown; B: the one made before it (else the newest other). Outputs: left, panel, slider, caption."""
    shown = entry_named(history, image)
    if shown is None:
        gr.Warning(NO_IMAGE)
        return (gr.skip(),) * 4
    after = history[history.index(shown) + 1:]
    others = [e for e in [*after, *history] if e.path != shown.path]
    right = next((e for e in others if Path(e.path).is_file()), None)  # the store's bound may have dropped some
    if right is None:
        gr.Warning(EXPIRED if others else ALONE)
        return (gr.skip(),) * 4
    return (shown.path, gr.Column(visible=True), (shown.path, right.path), describe_pair(shown, right))


def on_ab_pick(left: object, history: list[HistoryEntry], event: gr.SelectData) -> tuple[object, object]:
    """A history image clicked while comparing: it goes on the right. Outputs: slider, caption."""
    shown, right = entry_named(history, left), picked(history, event)
    if shown is None or right is None:
        return gr.skip(), gr.skip()
    if not Path(right.path).is_file():
        gr.Warning("That image has expired on the server: pick another of the history.")
        return gr.skip(), gr.skip()
    return (shown.path, right.path), describe_pair(shown, right)


def add_ab_panel(image: gr.Image, history: gr.State, history_gallery: gr.Gallery) -> None:
    """*Compare (A/B)* under the image, beside the result's other buttons, then the slider and its words, hidden until
    it is clicked; and their events: open, change the right side, close (queue=False: nothing here waits for the
    device)."""
    opener = gr.Button("Compare (A/B)", size="sm", elem_id="ab-open")
    with gr.Column(visible=False, elem_id="ab-panel") as panel:
        slider = gr.ImageSlider(label="A/B: drag the handle", type="filepath", interactive=False, elem_id="ab-slider",
                                buttons=["fullscreen"])
        caption = gr.Markdown(elem_id="ab-caption")
        close = gr.Button("Close the comparison", size="sm", elem_id="ab-close")
    left = gr.State(None)  # the path on the left (A) while the panel is open, else None
    opener.click(on_ab_open, [image, history], [left, panel, slider, caption], **TOLD).then(
        None, js=SHOW_PANEL, queue=False, api_visibility="private")
    history_gallery.select(on_ab_pick, [left, history], [slider, caption], **HIDDEN)
    close.click(lambda: (None, gr.Column(visible=False)), None, [left, panel], **HIDDEN)
