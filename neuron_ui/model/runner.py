"""One pipeline call as plain values, and the runner that makes it (with a prompt-embedding cache)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Callable

import torch
from PIL import Image

from neuron_ui.contract.errors import EngineError
from neuron_ui.contract.registry import BoundedRegistry
from neuron_ui.contract.results import ProgressUpdate
from neuron_ui.contract.stopping import Phase, Stopped
from neuron_ui.model.torch_bridge import execution_device

if TYPE_CHECKING:
    from neuron_ui.contract.requests import ValidRequest
    from neuron_ui.contract.results import ProgressFn
    from neuron_ui.contract.stopping import StopToken
    from neuron_ui.model.preview import StepPreviews


@dataclass(frozen=True)
class PipelineCall:
    """One pipeline run as plain values: what tensor-parallel followers receive to run in lockstep."""

    prompt: str
    width: int
    height: int
    steps: int
    seed: int
    guidance: float
    references: tuple[Image.Image, ...] = ()  # already fitted to a reference size
    image: Image.Image | None = None  # inpaint: the image, fitted to width x height
    mask: Image.Image | None = None
    strength: float = 1.0

    @classmethod
    def of(cls, valid: ValidRequest) -> PipelineCall:
        """The call for a request the engine accepted."""
        return cls(valid.prompt, valid.resolution.width, valid.resolution.height, valid.steps, valid.seed,
                   valid.guidance, tuple(r.image for r in valid.references),
                   valid.source.image if valid.source else None, valid.mask.image if valid.mask else None,
                   valid.strength)


def build_inpaint_pipeline(pipe):
    """klein's inpaint pipeline on the same modules, so it shares the weights and the compiled blocks.

    from_pipe casts the shared modules to float32 unless told the dtype: pass the pipeline's own."""
    from diffusers import Flux2KleinInpaintPipeline

    inpaint = Flux2KleinInpaintPipeline.from_pipe(pipe, dtype=pipe.dtype)
    inpaint.set_progress_bar_config(disable=True)
    return inpaint


def run_pipeline(pipe, call: PipelineCall, callback=None, prompt_embeds: torch.Tensor | None = None,
                 inpaint_pipe=None) -> Image.Image:
    """The plain diffusers call, as the upstream guide makes it; the inpaint pipeline when the call has an image."""
    # The generator lives on the CPU, as diffusers does for Neuron: same seed, same noise everywhere.
    generator = torch.Generator("cpu").manual_seed(call.seed)
    kwargs: dict[str, Any] = {}
    if call.image is not None:
        pipe = inpaint_pipe or build_inpaint_pipeline(pipe)
        kwargs = {"image": call.image, "mask_image": call.mask, "strength": call.strength,
                  "image_reference": list(call.references) or None}
    elif call.references:
        kwargs = {"image": list(call.references)}
    output = pipe(
        prompt=None if prompt_embeds is not None else call.prompt,
        prompt_embeds=prompt_embeds,
        height=call.height,
        width=call.width,
        num_inference_steps=call.steps,
        guidance_scale=call.guidance,
        generator=generator,
        callback_on_step_end=callback,
        output_type="pt",  # the pixels as numbers, checked before they become an image (finished_image)
        **kwargs,
    )
    return finished_image(output.images)


class NotFinite(EngineError):
    """The pipeline's pixels hold NaN or infinity: PIL would make them black without a word, so no image."""


def finished_image(images: torch.Tensor) -> Image.Image:
    """The first image of an output_type="pt" batch, converted as diffusers' "pil" output is
    (VaeImageProcessor.pt_to_numpy and numpy_to_pil, diffusers 0.42.1); NotFinite when a pixel is not finite
    (NaN latents decode to NaN pixels, and so do infinite ones)."""
    from diffusers.image_processor import VaeImageProcessor

    if not bool(torch.isfinite(images[:1]).all()):
        raise NotFinite("no image: its pixels came out as NaN or infinity, not finite numbers (a style or a "
                        "precision that overflows does this), so it was not delivered")
    return VaeImageProcessor.numpy_to_pil(VaeImageProcessor.pt_to_numpy(images[:1]))[0]


def step_callback(steps: int, report: ProgressFn, stop: StopToken, previews: StepPreviews | None = None) -> Callable:
    """diffusers' callback_on_step_end: progress after each of the `steps` steps, and a stop at the next one;
    with `previews`, each step's latents go to them (the estimate is made beside the next step)."""

    def on_step_end(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
        done = step + 1
        if stop.stopped:
            # Raised, not diffusers' `interrupt`: with interrupt the loop runs out its steps as no-ops and then
            # decodes the latents with the VAE for nobody; raising frees the device right after this step.
            raise Stopped(f"stopped after step {done}/{steps}; no image was made")
        if previews is not None:
            previews.take(pipe, done, callback_kwargs["latents"])
        report(ProgressUpdate(Phase.DENOISING, f"step {done}/{steps}", done / steps))
        if done == steps:
            report(ProgressUpdate(Phase.DECODING, "decoding the image", 1.0))
        return {}

    return on_step_end


def steps_run(steps: int, strength: float) -> int:
    """Denoising steps an inpaint runs: the pipeline skips the first (1 - strength) of the schedule."""
    return steps - int(max(steps - min(steps * strength, steps), 0))


EMBEDS_BYTES = 64 * 2**20  # klein-4B's embeddings are 3 x 2560 x 512 values: 7.9 MB each in bf16, 8 of them fit


class PipelineRunner:
    """Runs pipeline calls, remembering the last prompts' embeddings: a designer who changes only the seed,
    steps or size skips the text encoder (a 4B-parameter Qwen3 over 512 tokens on the real model). At most
    `cache_size` prompts and `cache_bytes` of embeddings are kept, the least recently used going first."""

    def __init__(self, pipe, cache_size: int = 8, cache_bytes: int = EMBEDS_BYTES):
        self.pipe = pipe
        self.inpaint_pipe = build_inpaint_pipeline(pipe)
        self._embeds: BoundedRegistry[str, torch.Tensor] = BoundedRegistry(cache_size)
        self.cache_bytes = cache_bytes

    def __call__(self, call: PipelineCall, callback=None) -> Image.Image:
        return run_pipeline(self.pipe, call, callback, prompt_embeds=self.prompt_embeds(call.prompt),
                            inpaint_pipe=self.inpaint_pipe)

    def describe(self) -> None:
        return None  # one process: no group behind it

    def prompt_embeds(self, prompt: str) -> torch.Tensor:
        cached = self._embeds.use(prompt)
        if cached is not None:
            return cached
        with torch.no_grad():
            embeds, _ = self.pipe.encode_prompt(prompt=prompt, device=execution_device(self.pipe))
        self._embeds[prompt] = embeds
        while sum(kept.nbytes for kept in self._embeds.values()) > self.cache_bytes:
            self._embeds.popitem(last=False)  # the least recently used; the new one too if it alone is too big
        return embeds


class Runner(Protocol):
    """What the engine runs calls with: a PipelineRunner, or a runner around one (rank 0's lockstep leader)."""

    def __call__(self, call: PipelineCall, callback: Callable | None = None) -> Image.Image: ...

    def describe(self) -> dict | None: ...  # the tensor-parallel group behind it (ranks, graphs), None alone

