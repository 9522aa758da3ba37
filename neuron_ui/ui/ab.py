"""A/B: the image shown against any image of the history, in Gradio's ImageSlider (InvokeAI's compare view).

*Compare (A/B)* under the image opens the slider with the image shown on the left (A) and the image made before it on
the right (B); while it is open, a click on the history puts that image on the right (and restores it, as a click
always does); *Close* goes back to the image alone. Only paths of the session's history reach the slider.
"""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from neuron_ui.ui.history import HistoryEntry, entry_named, picked  # at run time: Gradio reads the handlers' hints
from neuron_ui.web.files import page_script
from neuron_ui.web.gradio_bridge import HIDDEN, TOLD

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


def on_open(image: object, history: list[HistoryEntry]) -> tuple[object, ...]:
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


def on_pick(left: object, history: list[HistoryEntry], event: gr.SelectData) -> tuple[object, object]:
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
    opener.click(on_open, [image, history], [left, panel, slider, caption], **TOLD).then(
        None, js=SHOW_PANEL, queue=False, api_visibility="private")
    history_gallery.select(on_pick, [left, history], [slider, caption], **HIDDEN)
    close.click(lambda: (None, gr.Column(visible=False)), None, [left, panel], **HIDDEN)
