"""What goes in and out of the engine: requests, results, progress and status; plain dataclasses, no torch.

The UI and the CLI build requests and read results from here, so they never need to import torch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from .resolutions import Resolution, parse_resolution

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


@dataclass(frozen=True)
class ValidRequest:
    """A request the engine accepted, with every default filled in."""

    prompt: str
    resolution: Resolution
    steps: int
    seed: int
    guidance: float


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: object, limit: int = 40) -> str:
    """A rejected value as an error message quotes it: its repr, cut short (a request can send a megabyte)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


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


@dataclass(frozen=True)
class ProgressUpdate:
    """A stage of one request, in words a person can read; fraction is None when unknown."""

    stage: str  # waiting, compiling, denoising, decoding
    message: str
    fraction: float | None = None


ProgressFn = Callable[[ProgressUpdate], None]


@dataclass
class GenerateResult:
    """An image and the truth about how it was made."""

    image: Image.Image
    prompt: str
    resolution: str
    steps: int
    seed: int
    guidance: float
    model: str
    cache_event: str
    compile_seconds: float
    run_seconds: float
    total_seconds: float

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
        return meta

    def save_png(self, path: Path | str) -> Path:
        path = Path(path)
        self.image.save(path, format="PNG", pnginfo=self.png_info())
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
    compile_seconds: float | None = None
    estimate_seconds: float | None = None
    hits: int = 0
    last_latency: float | None = None
    error: str | None = None
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
    # With replicas (neuron_ui/replicas.py), one entry each: {"replica", "state", "busy", "graphs", "devices", ...}
    replicas: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def shape(self, resolution: str) -> ShapeStatus:
        return next(s for s in self.shapes if s.resolution == resolution)
