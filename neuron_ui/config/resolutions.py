"""The fixed resolution presets: the only way to pick a size, so every request is a static shape.

No torch here: the CLI validates presets before anything heavy is imported.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

MULTIPLE = 16
MIN_SIDE = 256
MAX_SIDE = 2048
_PATTERN = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\d+)\s*$")


@dataclass(frozen=True, order=True)
class Resolution:
    """A width x height preset, written "WIDTHxHEIGHT" like every image tool."""

    width: int
    height: int

    def __str__(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def tokens(self) -> int:
        """Latent tokens the transformer sees: the VAE downsamples 8x and packs 2x2 patches."""
        return (self.width // MULTIPLE) * (self.height // MULTIPLE)

    @property
    def aspect(self) -> str:
        """The aspect ratio in lowest terms, e.g. "16:9" for 1344x768 (7:4 exactly)."""
        d = math.gcd(self.width, self.height)
        return f"{self.width // d}:{self.height // d}"


def parse_resolution(text: object) -> Resolution:
    """Parse and validate one "WxH" string; ValueError says what is wrong and what is allowed."""
    if not isinstance(text, str):
        raise ValueError(f"resolution must be a string like '1024x1024', got {type(text).__name__}")
    match = _PATTERN.match(text)
    if not match:
        raise ValueError(f"resolution {text[:40]!r} is not of the form WIDTHxHEIGHT, e.g. '1024x1024'")
    width, height = int(match.group(1)), int(match.group(2))
    for name, side in (("width", width), ("height", height)):
        if not MIN_SIDE <= side <= MAX_SIDE:
            raise ValueError(f"resolution {text.strip()}: {name} {side} is outside {MIN_SIDE}..{MAX_SIDE}")
        if side % MULTIPLE:
            raise ValueError(f"resolution {text.strip()}: {name} {side} is not a multiple of {MULTIPLE}")
    return Resolution(width, height)


def parse_resolutions(text: str | list[str] | tuple[str, ...]) -> tuple[Resolution, ...]:
    """Parse a comma-separated preset list, keeping order and rejecting duplicates."""
    items = [t for t in (text.split(",") if isinstance(text, str) else text) if t.strip()]
    if not items:
        raise ValueError("the resolution list is empty; give at least one, e.g. '1024x1024'")
    presets: list[Resolution] = []
    for item in items:
        resolution = parse_resolution(item)
        if resolution in presets:
            raise ValueError(f"resolution {resolution} is listed twice")
        presets.append(resolution)
    return tuple(presets)


# 512x512 is the fast preview; the rest are klein's native sizes around one megapixel.
DEFAULT_RESOLUTIONS = parse_resolutions("512x512,1024x1024,1152x896,896x1152,1344x768,768x1344,1568x672,672x1568,"
                                        "1248x832,832x1248")
