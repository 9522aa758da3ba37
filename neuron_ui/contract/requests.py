"""What a caller asks for, and the checks every value passes before the engine takes it."""

from __future__ import annotations

import secrets
import unicodedata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from neuron_ui.contract import references as refs
from neuron_ui.contract.checks import NumberRange, shown

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from neuron_ui.config.resolutions import Resolution
    from neuron_ui.contract.layouts import Layout
    from neuron_ui.images.decode import ImageSource
    from neuron_ui.contract.references import FittedImage


MAX_PROMPT_CHARS = 2000
MAX_STEPS = 100
MAX_SEED = 2**32 - 1
MAX_GUIDANCE = 20.0


@dataclass
class GenerateRequest:
    """One image: a prompt at one of the presets. None means the model's default (or a random seed). Fields are as
    sent, checked by validate_request: steps and seed are whole numbers, a UI's number box sends them as floats."""

    prompt: str
    resolution: str
    steps: float | None = None
    seed: float | None = None
    guidance: float | None = None
    # Editing: reference images fitted to `reference_size` (None: the default); with `image` and `mask` the
    # request inpaints `image` (fitted to `resolution`) where the mask is white, at `strength` (None: 1.0).
    references: Sequence[ImageSource] = ()
    reference_size: str | None = None
    fit: str = "crop"
    image: ImageSource | None = None
    mask: ImageSource | None = None
    strength: float | None = None
    # A style (a LoRA loaded with --lora) by name, None for none; its strength, None for the style's default.
    lora: str | None = None
    lora_scale: float | None = None
    # Whose request it is, for fair turns on the device (engine.device_queue): the logged-in user, a browser session or
    # an API client's session; None: a visitor of its own. Not part of the image.
    visitor: str | None = None
    preview: bool = False  # report each step's estimate of the image (ProgressUpdate.preview), if the server allows


@dataclass(frozen=True)
class ValidRequest:
    """A request the engine accepted, with every default filled in."""

    prompt: str
    resolution: Resolution
    steps: int
    seed: int
    guidance: float
    references: tuple[FittedImage, ...] = ()
    source: FittedImage | None = None  # the image to inpaint, fitted to `resolution`
    mask: FittedImage | None = None
    strength: float = 1.0
    lora: str | None = None
    lora_scale: float | None = None  # set whenever lora is
    preview: bool = False  # it asked for step previews (made only where the server allows them)

    @property
    def inputs(self) -> list[FittedImage]:
        return [*self.references, *(f for f in (self.source, self.mask) if f is not None)]


ALLOWED_CONTROLS = "\t\n\r"  # a pasted prompt may be on several lines
PROMPT_TOKENS = 512  # klein's max_sequence_length: the text encoder reads this many tokens of a prompt


def count_prompt_tokens(tokenizer: Any, text: str) -> tuple[int, int]:
    """The tokens the text encoder gets for `text` (klein's chat template included), and how many it reads:
    past the limit, diffusers truncates and the rest of the prompt is ignored. No torch: the tokenizer only."""
    templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=False)
    return len(tokenizer(templated, verbose=False)["input_ids"]), PROMPT_TOKENS


def validate_prompt(prompt: object) -> str:
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be text, got {type(prompt).__name__}")
    prompt = prompt.strip()
    if not prompt:
        raise ValueError("prompt is empty: describe the image you want")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise ValueError(f"prompt is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
    try:
        prompt.encode("utf-8")  # the tokenizer and the PNG metadata need real text
    except UnicodeEncodeError:
        raise ValueError("prompt has characters that are not valid Unicode (unpaired surrogates)") from None
    # Control characters (NUL, ESC, DEL, C1) are never words; they would reach the PNG's text chunks and logs.
    controls = sorted({c for c in prompt if unicodedata.category(c) == "Cc" and c not in ALLOWED_CONTROLS})
    if controls:
        named = ", ".join(f"U+{ord(c):04X}" for c in controls[:5]) + (", …" if len(controls) > 5 else "")
        raise ValueError(f"prompt must be plain text: it has control characters ({named}); remove them "
                         "(tabs and new lines are fine)")
    # Zero-width spaces, joiners and other format characters alone draw nothing: no prompt at all.
    if not any(unicodedata.category(c)[0] in "LMNPS" for c in prompt):
        raise ValueError("prompt is empty: it has no visible characters (only spaces, zero-width or format "
                         "characters); describe the image you want")
    return prompt


STEPS = NumberRange("steps", 1, MAX_STEPS, whole=True)
SEED = NumberRange("seed", 0, MAX_SEED, whole=True, empty=" (or empty for random)")
GUIDANCE = NumberRange("guidance", 0.0, MAX_GUIDANCE)
STRENGTH = NumberRange("strength", 0.0, 1.0, above_low=True)  # above 0: at least one step runs; 1: from pure noise


MAX_LORA_SCALE = 2.0
NO_STYLE = "None"  # what the UI's Style dropdown shows for no style; the API takes it as None too
STYLE_SCALE = NumberRange("lora_scale", 0.0, MAX_LORA_SCALE, empty=" (or empty for the style's default)")


def validate_style(name: object, styles: Mapping[str, float], no_style: str = NO_STYLE) -> str | None:
    """A style by name (None, "" or "None": no style); ValueError names the ones loaded here, and no style as the
    caller's word for it (a grid's axis says "none")."""
    if name is None or name == "" or name == NO_STYLE:
        return None
    if not styles:
        raise ValueError(f"lora {shown(name)}: no styles are loaded on this server (start it with --lora PATH)")
    if not isinstance(name, str) or name not in styles:
        raise ValueError(f"lora {shown(name)} is not a style loaded here; allowed: {', '.join([no_style, *styles])}")
    return name


def require_inpaint_inputs(request: GenerateRequest) -> tuple[ImageSource, ImageSource]:
    """An inpaint redoes the masked part of an image: it needs both (returned, so both are known to be there)."""
    if request.image is None or request.mask is None:
        raise ValueError("inpainting needs both an image and a mask")
    return request.image, request.mask


def validate_request(request: GenerateRequest, layout: Layout, *, default_steps: int, default_guidance: float,
                     styles: Mapping[str, float] | None = None) -> ValidRequest:
    """Every field checked, defaults filled in (a random seed when none is given), input images fitted to their
    sizes; `layout` is the request's, checked already (Layouts.layout: its size and references); `styles` are the
    loaded styles' default strengths by name. ValueError names what is allowed."""
    styles = styles or {}
    lora = validate_style(request.lora, styles)
    # a strength without a style is checked, and no style (the page always sends its slider's value)
    scale = None if request.lora_scale is None else STYLE_SCALE.check(request.lora_scale)
    references = refs.fit_references(list(request.references), layout.references[0], refs.validate_fit(request.fit),
                                     len(layout.references)) if layout.references else ()
    source = mask = None
    if layout.inpaint:
        image, painted = require_inpaint_inputs(request)
        source = refs.fit_reference(image, layout.resolution, refs.validate_fit(request.fit), role="image")
        mask = refs.fit_mask(painted, source)
    return ValidRequest(
        prompt=validate_prompt(request.prompt),
        resolution=layout.resolution,
        steps=default_steps if request.steps is None else int(STEPS.check(request.steps)),
        seed=secrets.randbelow(2**32) if request.seed is None else int(SEED.check(request.seed)),
        guidance=default_guidance if request.guidance is None else GUIDANCE.check(request.guidance),
        references=references,
        source=source,
        mask=mask,
        strength=1.0 if request.strength is None else STRENGTH.check(request.strength),
        lora=lora,
        lora_scale=None if lora is None else styles[lora] if scale is None else scale,
        preview=request.preview,
    )
