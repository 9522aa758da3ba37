"""The named API for gradio_client (/generate, /inpaint, /grid, /ab, /warmup, /stop, /status): its own inputs, so the
engine, not the UI's widgets, checks them; each endpoint one studio call."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

import gradio as gr

from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.studio.grid_plan import AXIS_HELP
from neuron_ui.ui.editing import file_path, file_paths
from neuron_ui.web.errors import public_status, user_errors
from neuron_ui.web.gradio_bridge import Listen
from neuron_ui.ui.session import asker
from neuron_ui.ui.words import describe_stop

if TYPE_CHECKING:
    from gradio.components import Component

    from neuron_ui.contract.files import StoredFiles
    from neuron_ui.contract.results import EngineStatus, StepPreview
    from neuron_ui.studio.studio import PreviewSink, Studio
    from neuron_ui.web.files import PreviewFiles


class NamedApi:
    """The endpoints gradio_client calls by name; MCP's tools are named after these methods (server/mcp.py).
    `waiting`: the requests in Gradio's queue, not yet in the engine's."""

    def __init__(self, studio: Studio, stored: StoredFiles, previews: PreviewFiles, waiting: Callable[[], int]):
        self.studio, self.stored, self.previews, self.waiting = studio, stored, previews, waiting

    def status(self) -> EngineStatus:
        """The engine's status, its queue depth counting the requests still in Gradio's queue too."""
        status = self.studio.engine.status()
        return replace(status, queue_depth=status.queue_depth + self.waiting())

    def api_generate(self, prompt: str, resolution: str, steps: float | None = None, seed: float | None = None,
                     guidance: float | None = None, references: object = None, reference_size: str | None = None,
                     lora: str | None = None, lora_scale: float | None = None,
                     preview: bool | None = None) -> Iterator[tuple[str, dict[str, object]]]:
        """/generate: one image and its generation info; steps and guidance default to the model's, seed to random;
        `lora` a loaded style's name (None: none), `lora_scale` its strength (None: the style's default). With
        preview=True each step's estimate of the image comes first, as (image at the latents' resolution,
        {"preview": {"step", "steps"}}): gradio_client's job.outputs()."""
        if preview not in (None, False, True):
            raise gr.Error(f"preview must be true or false, got {preview!r}", print_exception=False)

        def make(on_preview: PreviewSink | None = None) -> tuple[str, dict[str, object]]:
            with user_errors():
                request = GenerateRequest(prompt, resolution, steps, seed, guidance,
                                          references=file_paths(references, self.stored),
                                          reference_size=reference_size or None, lora=lora, lora_scale=lora_scale)
                made = self.studio.generate(request, asker(on_preview=on_preview))
                return str(made.path), made.result.info()

        def frame(path: str, preview: StepPreview) -> tuple[str, dict[str, object]]:  # a step's, before the image
            return path, {"preview": {"step": preview.step, "steps": preview.steps}}

        yield from self.previews.shown(make, frame) if preview else [make()]

    def api_inpaint(self, image: object, mask: object, prompt: str, strength: float | None = None,
                    resolution: Any = None, steps: float | None = None, seed: float | None = None,
                    references: object = None, reference_size: str | None = None, lora: str | None = None,
                    lora_scale: float | None = None) -> tuple[str, dict[str, object]]:
        """Redo the white part of `mask` in `image` (both fitted to `resolution`); same result dict as /generate;
        `lora` and `lora_scale` as for /generate. Values arrive as sent (preprocess=False): the engine checks them."""
        with user_errors():
            image, mask = file_path(image, self.stored), file_path(mask, self.stored)
            if image is None or mask is None:
                raise ValueError("inpainting needs both an image and a mask")
            request = GenerateRequest(prompt, resolution, steps, seed,
                                      references=file_paths(references, self.stored),
                                      reference_size=reference_size or None, image=image, mask=mask,
                                      strength=strength, lora=lora, lora_scale=lora_scale)
            made = self.studio.inpaint(request, asker())
            return str(made.path), made.result.info()

    def api_grid(self, prompt: str, resolution: str, seeds: str | None = None, styles: str | None = None,
                 strengths: str | None = None, steps: str | None = None,
                 prompts: str | None = None) -> tuple[str, dict[str, object]]:
        """A grid of images along up to three axes (studio/grid_plan.py), one cell at a time like any other image:
        the sheet's PNG, and info: each cell (parameters, cache_event, seconds, image) and the style switches made."""
        with user_errors():
            axes = {"seeds": seeds, "styles": styles, "strengths": strengths, "steps": steps, "prompts": prompts}
            sheet = self.studio.grid(self.studio.plan_grid(prompt, resolution, axes), asker())
            return str(sheet.path), sheet.info()

    def api_ab(self, prompt: str, resolution: str, a: str | None = None,
               b: str | None = None) -> tuple[str, dict[str, object]]:
        """Two images that differ in named settings (studio/ab.py), side by side: the labelled PNG, and info:
        `a` and `b` (parameters, cache_event, seconds, image) and `differs`. Made as a two-cell grid: one request."""
        with user_errors():
            sheet = self.studio.ab(self.studio.plan_ab(prompt, resolution, a, b), asker())
            return str(sheet.path), sheet.info()

    def api_warmup(self, resolution: str) -> dict[str, object]:
        """Compile one preset without making an image; returns its status."""
        with user_errors():
            return asdict(self.studio.warmup(resolution, asker()))

    def api_stop(self, request: gr.Request) -> dict[str, object]:
        """Stop this client's requests (its session): a running image at the next step, a queued one at once."""
        phases = self.studio.stops.stop(request.session_hash)
        return {"stopped": phases, "message": describe_stop(phases).replace("**", "")}

    def api_status(self) -> dict[str, object]:
        """The engine status: every preset's state, compile seconds, hits and last latency."""
        return public_status(self.status())


def add_named_api(api: NamedApi, on_device: Listen) -> None:
    """Every endpoint, inside the Blocks being built. /generate, /inpaint, /grid and /ab each have their own hidden
    inputs (made inside a hidden column), so the engine, not the UI's widgets, checks them: preprocess=False, the
    values as sent (a number for the prompt is refused, not made text); each answers a PNG (labelled by what it
    shows) and the info."""
    def texts(*labels: str) -> list[Component]:
        return [gr.Textbox(label=label) for label in labels]

    def numbers(*labels: str) -> list[Component]:
        return [gr.Number(label=label) for label in labels]

    def edits() -> list[Component]:  # the optional references and style of /generate and /inpaint
        return [gr.File(label="references", file_count="multiple", file_types=["image"]),
                *texts("reference_size", "lora"), *numbers("lora_scale")]

    endpoints: dict[str, tuple[Callable[..., object], str, Callable[[], list[Component]]]] = {
        "generate": (api.api_generate, "image", lambda: [*texts("prompt", "resolution"),
                                                         *numbers("steps", "seed", "guidance"), *edits(),
                                                         gr.Checkbox(label="preview")]),
        "inpaint": (api.api_inpaint, "image", lambda: [
            gr.Image(label="image", type="filepath"), gr.Image(label="mask", type="filepath"), *texts("prompt"),
            *numbers("strength"), *texts("resolution"), *numbers("steps", "seed"), *edits()]),
        "grid": (api.api_grid, "grid_png", lambda: texts("prompt", "resolution", *AXIS_HELP)),
        "ab": (api.api_ab, "ab_png", lambda: texts("prompt", "resolution", "a", "b")),
    }
    for name, (fn, image, inputs) in endpoints.items():
        with gr.Column(visible=False):
            given = inputs()
            outputs = [gr.Image(label=image, type="filepath", format="png"), gr.JSON(label="info")]
            trigger = gr.Button()
        trigger.click(fn, given, outputs, api_name=name, preprocess=False, **on_device)
    gr.api(api.api_warmup, api_name="warmup", **on_device)
    gr.api(api.api_status, api_name="status", concurrency_limit=None)
    gr.api(api.api_stop, api_name="stop", concurrency_limit=None)
