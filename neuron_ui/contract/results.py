"""What comes back: an image and the truth about how it was made, progress, and status."""

from __future__ import annotations

import copy
import io
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, TypedDict, cast
from collections.abc import Callable

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from neuron_ui.contract.errors import Kind
from neuron_ui.contract.stopping import Phase
from neuron_ui.images.png import write_png

if TYPE_CHECKING:
    from neuron_ui.contract.references import InputMeta


# A shape's state on this server (a cold one may still be on disk: ShapeStatus.on_disk), and where a request is as
# its progress tells it: the Phase members each can be, so that "compiling" is one word of one enum.
ShapeState = Literal[Phase.COLD, Phase.COMPILING, Phase.READY, Phase.FAILED]
Stage = Literal[Phase.WAITING, Phase.COMPILING, Phase.DENOISING, Phase.DECODING]


class CacheEvent(Kind):
    """What happened to the compile cache during one request (neuron_ui.compile.counters proves which)."""

    COMPILED = "compiled"  # compiled from scratch
    DISK_HIT = "disk_hit"  # traced again, but the persistent cache supplied the compiled artifacts
    MEMORY_HIT = "memory_hit"  # this process already had the graph
    EAGER = "eager"  # no compilation in this mode


class Mode(Kind):
    """What a request made: an image from a prompt, or an edit of the painted part of one."""

    GENERATE = "generate"
    INPAINT = "inpaint"


MAX_PREVIEW_SIDE = 1024  # pixels: a preview is at the latents' resolution (1/8 of the image's side)


@dataclass(frozen=True)
class StepPreview:
    """One step's estimate of the finished image, at the latents' resolution (128x128 for 1024x1024): raw RGB, row
    by row, cheap to make at every step; a page draws it larger, the replicas carry it as a PNG."""

    step: int  # 1-based, of `steps` (the steps the pipeline runs)
    steps: int
    width: int
    height: int
    rgb: bytes = field(repr=False)

    def image(self) -> Image.Image:
        return Image.frombytes("RGB", (self.width, self.height), self.rgb)

    def png(self) -> bytes:
        """Small and quick (zlib level 1): what crosses a process boundary."""
        out = io.BytesIO()
        self.image().save(out, format="PNG", compress_level=1)
        return out.getvalue()

    @classmethod
    def from_png(cls, step: int, steps: int, data: bytes) -> StepPreview:
        """Read back a preview's PNG; ValueError for one larger than any preview can be."""
        with Image.open(io.BytesIO(data)) as image:
            if max(image.size) > MAX_PREVIEW_SIDE:
                raise ValueError(f"a step preview of {image.width}x{image.height} is larger than any preview")
            rgb = image.convert("RGB")
        return cls(step, steps, rgb.width, rgb.height, rgb.tobytes())


@dataclass(frozen=True)
class ProgressUpdate:
    """A stage of one request, in words a person can read; fraction is None when unknown."""

    stage: Stage
    message: str
    fraction: float | None = None
    # While compiling: the phase (COMPILING, or LOADING from the disk cache), the estimate of the whole
    # wait, and whether that estimate is a built-in guess (nothing measured on this machine yet).
    phase: Phase | None = None
    estimate_seconds: float | None = None
    guess: bool = False
    # A step's estimate of the finished image, only for a request that asked for previews (sent on its own update,
    # possibly from another thread: a bar ignores it).
    preview: StepPreview | None = None


ProgressFn = Callable[[ProgressUpdate], None]


# zlib level 1, not PIL's 6, for the PNGs nobody waits on in a round trip (the headless command's, MCP's): on a
# 1024x1024 photo level 1 took 0.14 s against 0.21 s for a file 15% larger (1.44 MB vs 1.25 MB). The images the
# UI and the API serve are written uncompressed instead (save_png(fast=True), images/png.py).
PNG_COMPRESS_LEVEL = 1


def save_deflated(image: Image.Image, target: Path | str | IO[bytes], text: list[tuple[str, str]]) -> None:
    """`image` as a deflated PNG (smaller, slower to write than images/png.py's) with `text` as its text chunks:
    for a file kept (the CLI's) or sent (MCP's)."""
    meta = PngInfo()
    for key, value in text:
        meta.add_text(key, value)
    image.save(target, format="PNG", pnginfo=meta, compress_level=PNG_COMPRESS_LEVEL)


def save_image_png(image: Image.Image, path: Path | str, text: list[tuple[str, str]], fast: bool = False) -> Path:
    """`image` at `path` with `text`; `fast` for one a user waits on: uncompressed, written in milliseconds
    (images/png.py), else deflated (save_deflated)."""
    if fast:
        return write_png(image, path, text)
    save_deflated(image, path, text)
    return Path(path)


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
    cache_event: CacheEvent
    compile_seconds: float
    run_seconds: float
    total_seconds: float
    mode: Mode = Mode.GENERATE
    strength: float | None = None  # inpaint only
    tokens: int | None = None  # the transformer's image sequence: output + source image + references
    inputs: list[InputMeta] = field(default_factory=list)  # FittedImage.meta() of each input image
    # Time before this request had the device (the queue, someone else's compile), apart from its own time
    # (total_seconds): e.g. "1152x896 to compile", "2 images ahead"; None when it did not wait.
    waited_seconds: float = 0.0
    waited_for: str | None = None
    replica: str | None = None  # with --replicas, the replica that made it (the /metrics `replica` label)
    lora: str | None = None  # the style that made it (None: none), its strength and its file's sha256
    lora_scale: float | None = None
    lora_sha256: str | None = None

    def info(self) -> dict[str, object]:
        """Everything but the image, JSON-ready (asdict would copy the image too: 11 ms at 1024x1024)."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "image"}

    def png_text(self) -> list[tuple[str, str]]:
        """Parameters in the PNG itself, so a saved image remembers how to make it again."""
        text = [("parameters", json.dumps(self.info(), sort_keys=True))]
        text += [(key, str(getattr(self, key))) for key in ("prompt", "resolution", "steps", "seed", "model")]
        text.append(("guidance", "not used" if self.guidance is None else f"{self.guidance:g}"))
        if self.lora is not None:
            text.append(("lora", f"{self.lora} at {self.lora_scale:g} (sha256 {self.lora_sha256})"))
        return text

    def save_png(self, path: Path | str, fast: bool = False) -> Path:
        """The PNG with its parameters (`fast`: save_image_png's)."""
        return save_image_png(self.image, path, self.png_text(), fast)


@dataclass
class ShapeStatus:
    """One preset as this process sees it."""

    resolution: str
    aspect: str
    tokens: int
    state: ShapeState
    on_disk: bool = False
    warmup_queued: bool = False
    shares_graph_with: str | None = None
    # Measured in this run (3 decimals), None otherwise: the compile from scratch, or the load from the disk cache, of
    # its graph (a size sharing a graph gets its time)
    compile_seconds: float | None = None
    load_seconds: float | None = None
    # Until ready and on disk: what earlier runs measured, as the disk cache's manifest keeps it (3 decimals)
    recorded_compile_seconds: float | None = None
    recorded_load_seconds: float | None = None
    estimate_seconds: float | None = None  # until ready: a load when on disk, else a compile (0.1 s); None if unknown
    estimate_guess: bool = False  # the estimate is a built-in guess: this machine has measured no compile yet
    hits: int = 0  # images served from the compiled graph in memory (memory_hit)
    images: int = 0  # images made at this size, whatever the cache did
    last_latency: float | None = None
    error: str | None = None
    layout: str | None = None  # e.g. "inpaint 512x512 + 1 ref 1024x1024"; None for a plain preset
    ready_on: int | None = None  # with replicas: how many hold this size's graph now, of replicas_total
    replicas_total: int | None = None

    def __post_init__(self) -> None:
        self.state = cast(ShapeState, Phase(self.state))  # one read back from JSON is the enum again


class ReplicaRow(TypedDict):
    """The status's row for one replica (EngineStatus.replicas: plain dicts for the UI and /metrics)."""

    replica: str
    pid: int
    node: str
    devices: str
    busy: bool
    images: int
    graphs: list[int]  # the token counts whose graph it holds
    state: str  # "healthy" or "not responding"
    seen_seconds_ago: float


@dataclass
class EngineStatus:
    """What never changes while an engine serves (its model, device, defaults), and what does: the cache, the device's
    queue, every size's state (the /status API's JSON)."""

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
    visitors_waiting: int = 0  # how many visitors those requests belong to (never who)
    warmup_queue: list[str] = field(default_factory=list)
    warmup_seconds_left: float = 0.0  # about how long the rest of the warm-up list should take
    shapes: list[ShapeStatus] = field(default_factory=list)
    layouts: list[ShapeStatus] = field(default_factory=list)  # output size x references/inpaint, as used here
    reference_sizes: list[str] = field(default_factory=list)
    max_references: int = 0
    replicas: list[ReplicaRow] | None = None  # with replicas (neuron_ui/replicas/), one row each
    replica_states: dict[str, int] | None = None  # Ray Serve's count per replica state: RUNNING, STARTING, ...
    # The styles loaded (--lora): name, default_scale, sha256, layers, rank, host_mb, and `fused`: the strength it
    # is fused at in the weights now, None when not (engine/styles.py)
    styles: list[dict[str, Any]] = field(default_factory=list)
    styles_refused: dict[str, str] = field(default_factory=dict)  # a --lora left out at load -> why, in one line

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def shape(self, resolution: str) -> ShapeStatus:
        return next(s for s in self.shapes if s.resolution == resolution)
