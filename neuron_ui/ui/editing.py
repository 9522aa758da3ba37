"""Editing in the UI and the API: reference images with "what the model sees", and inpainting; no torch.

`build_demo` (blocks.py) calls `add_reference_panel` and `add_inpaint_tab` inside its Blocks (the API's inputs are
named_api's); the functions here translate Gradio values (file dicts, the image editor's layers) into GenerateRequest
fields. Every file value names one of the app's files or is refused unread (contract/files.py, the rule the gate
applies too); the engine checks and fits the images (contract/references.py), and the editor's layers are read the
same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import gradio as gr
from PIL import Image

from neuron_ui.contract import references as refs
from neuron_ui.images.decode import decoded, on_decoder
from neuron_ui.ui.words import describe_size
from neuron_ui.web.errors import user_errors
from neuron_ui.web.gradio_bridge import HIDDEN

if TYPE_CHECKING:
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.contract.files import StoredFiles


DEFAULT_STRENGTH = 0.9


def file_path(value: object, stored: StoredFiles) -> str | None:
    """A Gradio file value (a FileData dict with or without "meta", or a path) as the path of one of the app's
    files; ForeignFile (a ValueError: one line) for any other, before anything reads it."""
    if value is None or value == "":
        return None
    return stored.use(value.get("path") if isinstance(value, dict) else value)


def file_paths(values: object, stored: StoredFiles) -> list[str]:
    items = values if isinstance(values, (list, tuple)) else [] if values is None else [values]
    return [p for p in (file_path(v, stored) for v in items) if p]


@on_decoder
def painted_mask(background: str, layers: list[str]) -> Image.Image:
    """The editor's painted layers merged into one mask (L, painted = 255) the size of its background.

    Each is read like any upload (images/decode.py: size, pixels, what it is, the decoding threads). The layers
    are the editor's canvas size; they are scaled to the background's size so the mask always fits it."""
    with decoded(background, "image") as (image, _, _):
        size = image.size  # after EXIF orientation, as the engine fits it
    mask = Image.new("L", size, 0)
    for number, layer in enumerate(layers, 1):
        with decoded(layer, f"painted layer {number}") as (painted, _, _):
            alpha = painted.getchannel("A") if painted.mode == "RGBA" else painted.convert("RGBA").getchannel("A")
        alpha = alpha.point(lambda v: 255 if v > 0 else 0)
        if alpha.size != size:
            alpha = alpha.resize(size, Image.Resampling.NEAREST)
        mask.paste(255, mask=alpha)
    return mask


@dataclass
class EditingHandlers:
    """Handlers for the editing inputs that make nothing (Inpaint's click is ui.Handlers.on_inpaint, /inpaint the
    named API's): `stored` is the rule for the files a request may name."""

    engine: EngineLike
    stored: StoredFiles

    def on_preview(self, files: object, reference_size: str, fit: str) -> list[tuple[Image.Image, str]]:
        """What the model sees: each reference fitted, before anything runs; a bad file says why at once."""
        try:  # a file that is not the app's (ForeignFile), too many, a bad size: each a ValueError, said at once
            paths = file_paths(files, self.stored)
            if len(paths) > self.engine.max_references:
                raise ValueError(f"{len(paths)} reference images; this server takes at most "
                                 f"{self.engine.max_references}")
            size = refs.validate_reference_size(reference_size, self.engine.reference_sizes)
            fitted = refs.fit_references(paths, size, fit, self.engine.max_references)
        except ValueError as error:
            gr.Warning(str(error))
            return []
        for item in fitted:
            for note in item.notes:
                gr.Info(note)
        return [(f.image, f"{f.role}: {f.source_size[0]}x{f.source_size[1]} → {f.size} ({f.fit})") for f in fitted]

    def on_layout(self, resolution: str, files: object, reference_size: str, editing: bool = False) -> str:
        """What the next image's layout costs, before the click, when it is not the size alone (the size hint's):
        Generate's with references, and while the inpaint editor holds an image (`editing`: add_inpaint_tab's `holds`,
        not the editor, whose files Gradio uploads each time it reads them), Inpaint's too (its source image
        doubles the output's tokens: another graph)."""
        try:
            count = min(len(file_paths(files, self.stored)), self.engine.max_references)
            if not count and not editing:
                return ""  # the size hint above says it: on a wide page "Ready..." showed twice
            plain = describe_size(self.engine.layout_status(self.engine.layout(resolution, count, reference_size)))
            if not editing:
                return plain
            inpaint = self.engine.layout(resolution, count, reference_size, inpaint=True)
        except ValueError as error:
            return str(error)
        return f"Inpaint: {describe_size(self.engine.layout_status(inpaint))}\n\nGenerate: {plain}"

    def on_use_as_reference(self, image: str | None, files: object) -> object:
        """Put the shown result among the references (the oldest drops out when full)."""
        if not image:
            gr.Warning("No image yet: generate one first.")
            return gr.skip()
        with user_errors():
            paths = [*file_paths(files, self.stored), file_path(image, self.stored)]
        return paths[-self.engine.max_references:] if self.engine.max_references else []

    @staticmethod
    def on_edit_image(image: str | None) -> tuple[object, object]:
        """Open the shown result in the inpaint editor, which then holds an image (the page opens its panel:
        assets/edit.js)."""
        if not image:
            gr.Warning("No image yet: generate one first.")
            return gr.skip(), gr.skip()
        return {"background": image, "layers": [], "composite": image}, True


def add_reference_panel(handlers: EditingHandlers) -> tuple[gr.File, gr.Dropdown, gr.Radio]:
    """Reference uploads, their size and fit, and the previews of what the model sees, which follow them."""
    engine = handlers.engine
    sizes = [str(s) for s in engine.reference_sizes]
    with gr.Accordion(f"Reference images (up to {engine.max_references})", open=False, elem_id="references",
                      visible=engine.max_references > 0):
        files = gr.File(label="References", file_count="multiple", file_types=["image"], elem_id="reference-files")
        with gr.Row():
            size = gr.Dropdown(sizes, value=sizes[0], label="Reference size", elem_id="reference-size",
                               info="every reference is fitted to this size, so no upload adds a new shape")
            fit = gr.Radio(list(refs.FIT_MODES), value="crop", label="Fit", elem_id="reference-fit",
                           info="crop: fill, cut the centre · pad: keep all, black bars")
        previews = gr.Gallery(label="What the model sees", columns=4, height=160, allow_preview=False,
                              elem_id="reference-previews")
    gr.on([files.change, size.change, fit.change], handlers.on_preview, [files, size, fit], previews, **HIDDEN)
    return files, size, fit


def add_inpaint_tab() -> tuple[gr.ImageEditor, gr.ImageEditor, gr.Checkbox, gr.Slider, gr.Button]:
    """The inpaint inputs: the image editor to paint the mask on, `sent`, `holds`, strength and the button. `holds`
    (rendered, hidden) says whether the editor holds an image, `sent` (hidden) is its value once its files are
    uploaded for Inpaint.

    Gradio 6.31's editor uploads its background, composite and painted layers each time Gradio reads it (get_data,
    @gradio/imageeditor): for every event it is an input or a trigger of (the event's args), at such an event's first
    message, and at every status message of any event once it, or a block around it, has been an event's progress
    target; the 2 s refresh timer made that about 24 uploads while a mask was painted (issue 35). So no event is
    triggered by it, shows progress on it or updates the panel around it (blocks.py), and only Inpaint's first,
    page-only step reads it: one upload of its files, its value handed to `sent`, which the request reads. `holds` is
    set by the server where an image comes in by Edit this image or a history pick, and by the page for a file or a
    clear (assets/page.js)."""
    brush = gr.Brush(default_size=32, colors=["#ff00ff"], color_mode="fixed")
    editor = gr.ImageEditor(label="Paint over the part to redo", type="filepath", height=360, layers=False,
                            brush=brush, elem_id="inpaint-editor")
    sent = gr.ImageEditor(type="filepath", layers=False, visible=False)
    holds = gr.Checkbox(False, label="the editor holds an image", visible="hidden", elem_id="editor-holds")
    strength = gr.Slider(0.05, 1.0, value=DEFAULT_STRENGTH, step=0.05, label="Strength", elem_id="strength",
                         info="how much of the painted part is redone (1: from scratch)")
    button = gr.Button("Inpaint", variant="primary", elem_id="inpaint")
    return editor, sent, holds, strength, button

