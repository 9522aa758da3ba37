"""What goes in and out of the engine: requests, results, progress and status; plain dataclasses, no torch.

The UI and the CLI build requests and read results from here, so they never need to import torch.
"""

from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from .references import FittedImage, ImageSource
from .resolutions import Resolution, parse_resolution

if TYPE_CHECKING:
    from .graphs import Layout

MAX_PROMPT_CHARS = 2000
MAX_STEPS = 100
MAX_SEED = 2**32 - 1
MAX_GUIDANCE = 20.0

# Shape states; "cold" shapes may still be on disk (ShapeStatus.on_disk).
COLD, COMPILING, READY, FAILED = "cold", "compiling", "ready", "failed"


class EngineError(RuntimeError):
    """A request failed on the server side; the message is safe to show to the user."""

    def __init__(self, message: str, kind: str = "generation_failed"):
        super().__init__(message)
        self.kind = kind


@dataclass
class GenerateRequest:
    """One image: a prompt at one of the presets. None means the model's default (or a random seed)."""

    prompt: str
    resolution: str
    steps: int | None = None
    seed: int | None = None
    guidance: float | None = None
    # Editing: reference images fitted to `reference_size` (None: the default); with `image` and `mask` the
    # request inpaints `image` (fitted to `resolution`) where the mask is white, at `strength` (None: 1.0).
    references: tuple[ImageSource, ...] | list[ImageSource] = ()
    reference_size: str | None = None
    fit: str = "crop"
    image: ImageSource | None = None
    mask: ImageSource | None = None
    strength: float | None = None


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

    @property
    def inputs(self) -> list[FittedImage]:
        return [*self.references, *(f for f in (self.source, self.mask) if f is not None)]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: object, limit: int = 40) -> str:
    """A rejected value as an error message quotes it: its repr, cut short (a request can send a megabyte)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


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


def validate_resolution(resolution: object, presets: tuple[Resolution, ...]) -> Resolution:
    allowed = ", ".join(str(p) for p in presets)
    if isinstance(resolution, str) and len(resolution) > 40:  # longer than any "WxH": neither parsed nor echoed
        raise ValueError(f"resolution {_shown(resolution)} is not a preset; allowed: {allowed}")
    try:
        parsed = parse_resolution(resolution)
    except ValueError as error:
        raise ValueError(f"{error}; allowed: {allowed}") from None
    if parsed not in presets:
        raise ValueError(f"resolution {parsed} is not a preset; allowed: {allowed}")
    return parsed


def validate_steps(steps: object) -> int:
    if isinstance(steps, float) and steps.is_integer():
        steps = int(steps)
    if not _is_int(steps) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be a whole number from 1 to {MAX_STEPS}, got {_shown(steps)}")
    return steps


def validate_seed(seed: object) -> int:
    if isinstance(seed, float) and seed.is_integer():
        seed = int(seed)
    if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be a whole number from 0 to {MAX_SEED} (or empty for random), got {_shown(seed)}")
    return seed


def validate_guidance(guidance: object) -> float:
    if _is_int(guidance):
        guidance = float(guidance)
    if not isinstance(guidance, float) or not math.isfinite(guidance) or not 0.0 <= guidance <= MAX_GUIDANCE:
        raise ValueError(f"guidance must be a number from 0 to {MAX_GUIDANCE:g}, got {_shown(guidance)}")
    return guidance


def validate_strength(strength: object) -> float:
    """How much of the masked part is redone: above 0 (at least one step runs) up to 1 (from pure noise)."""
    if _is_int(strength):
        strength = float(strength)
    if not isinstance(strength, float) or not math.isfinite(strength) or not 0.0 < strength <= 1.0:
        raise ValueError(f"strength must be a number above 0 and at most 1, got {_shown(strength)}")
    return strength


@dataclass(frozen=True)
class ProgressUpdate:
    """A stage of one request, in words a person can read; fraction is None when unknown."""

    stage: str  # waiting, compiling, denoising, decoding
    message: str
    fraction: float | None = None
    # While compiling: the phase (tracing, compiling, loading: from the disk cache), the estimate of the whole
    # wait, and whether that estimate is a built-in guess (nothing measured on this machine yet).
    phase: str | None = None
    estimate_seconds: float | None = None
    guess: bool = False


ProgressFn = Callable[[ProgressUpdate], None]


# zlib level 1, not PIL's 6: every image waits for its PNG before it is sent. On a 1024x1024 photo level 1 took
# 0.14 s against 0.21 s for a file 15% larger (1.44 MB vs 1.25 MB); level 0 (0.05 s) made it 2.2x larger (3.1 MB).
PNG_COMPRESS_LEVEL = 1

@dataclass
class GenerateResult:
    """An image and the truth about how it was made."""

    image: Image.Image
    prompt: str
    resolution: str
    steps: int
    seed: int
    guidance: float | None  # the guidance scale diffusers applied; None when it applied none (step-distilled model)
    model: str
    cache_event: str
    compile_seconds: float
    run_seconds: float
    total_seconds: float
    mode: str = "generate"  # or "inpaint"
    strength: float | None = None  # inpaint only
    tokens: int | None = None  # the transformer's image sequence: output + source image + references
    inputs: list[dict[str, Any]] = field(default_factory=list)  # FittedImage.meta() of each input image
    # Time before this request had the device (the queue, someone else's compile), apart from its own time
    # (total_seconds): e.g. "1152x896 to compile", "2 images ahead"; None when it did not wait.
    waited_seconds: float = 0.0
    waited_for: str | None = None

    def info(self) -> dict[str, Any]:
        """Everything but the image, JSON-ready."""
        data = asdict(self)
        data.pop("image")
        return data

    def png_info(self) -> PngInfo:
        """Parameters in the PNG itself, so a saved image remembers how to make it again."""
        meta = PngInfo()
        meta.add_text("parameters", json.dumps(self.info(), sort_keys=True))
        for key in ("prompt", "resolution", "steps", "seed", "model"):
            meta.add_text(key, str(getattr(self, key)))
        meta.add_text("guidance", "not used" if self.guidance is None else f"{self.guidance:g}")
        return meta

    def save_png(self, path: Path | str) -> Path:
        path = Path(path)
        self.image.save(path, format="PNG", pnginfo=self.png_info(), compress_level=PNG_COMPRESS_LEVEL)
        return path


@dataclass
class ShapeStatus:
    """One preset as this process sees it."""

    resolution: str
    aspect: str
    tokens: int
    state: str
    on_disk: bool = False
    warmup_queued: bool = False
    shares_graph_with: str | None = None
    compile_seconds: float | None = None  # the latest compile from scratch
    load_seconds: float | None = None  # the latest load of its compiled graph from the disk cache
    estimate_seconds: float | None = None  # until ready: a load when on disk, else a compile; None if unknown
    estimate_guess: bool = False  # the estimate is a built-in guess: this machine has measured no compile yet
    hits: int = 0  # images served from the compiled graph in memory (memory_hit)
    images: int = 0  # images made at this size, whatever the cache did
    last_latency: float | None = None
    error: str | None = None
    layout: str | None = None  # e.g. "inpaint 512x512 + 1 ref 1024x1024"; None for a plain preset
    ready_on: int | None = None  # with replicas: how many hold this size's graph now, of replicas_total
    replicas_total: int | None = None


@dataclass
class EngineStatus:
    model: str
    device: str
    dtype: str
    compile_mode: str
    compile_backend: str
    is_tiny: bool
    fallback_reason: str | None
    distilled: bool
    default_steps: int
    default_guidance: float
    cache_dir: str
    persistent_cache: bool
    cache_error: str | None
    busy: bool
    tensor_parallel: dict | None = None  # {"degree": N, "ranks": [{"rank", "graphs", "calls", "alive"}]}
    queue_depth: int = 0
    warmup_queue: list[str] = field(default_factory=list)
    warmup_seconds_left: float = 0.0  # about how long the rest of the warm-up list should take
    shapes: list[ShapeStatus] = field(default_factory=list)
    layouts: list[ShapeStatus] = field(default_factory=list)  # output size x references/inpaint, as used here
    reference_sizes: list[str] = field(default_factory=list)
    max_references: int = 0
    # With replicas (neuron_ui/replicas.py), one entry each: {"replica", "state", "busy", "graphs", "devices", ...}
    replicas: list[dict[str, Any]] | None = None
    replica_states: dict[str, int] | None = None  # Ray Serve's count per replica state: RUNNING, STARTING, ...

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def shape(self, resolution: str) -> ShapeStatus:
        return next(s for s in self.shapes if s.resolution == resolution)


class EngineLike(Protocol):
    """The one seam between the UI (and the server) and whatever makes images: neuron_ui.engine.Engine in this
    process, or neuron_ui.replicas.ReplicaClient over Ray Serve. Errors: ValueError for bad input, EngineError."""

    presets: tuple[Resolution, ...]
    max_references: int
    reference_sizes: tuple[Resolution, ...]

    def generate(self, request: GenerateRequest, progress: ProgressFn | None = None,
                 stop: Any = None) -> GenerateResult: ...  # stop: a neuron_ui.stopping.StopToken
    def inpaint(self, request: GenerateRequest, progress: ProgressFn | None = None,
                stop: Any = None) -> GenerateResult: ...
    def warmup(self, resolution: str, progress: ProgressFn | None = None) -> ShapeStatus: ...
    def prompt_tokens(self, text: str) -> tuple[int, int]: ...
    def start_warmup(self, resolutions: list[str]) -> None: ...
    def layout(self, resolution: str, references: int = 0, reference_size: str | None = None,
               inpaint: bool = False) -> Layout: ...
    def layout_status(self, layout: Layout) -> ShapeStatus: ...
    def status(self) -> EngineStatus: ...
    def drain(self, timeout: float) -> bool: ...
