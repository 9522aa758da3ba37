"""Input images for editing (references, the image to inpaint, its mask), fitted to fixed sizes; no torch.

diffusers resizes a reference to at most 1 MP and floors it to a multiple of 16, so every upload size would be a
new sequence length, and on Neuron a new compilation. Here every input is fitted to a preset first (centre crop
by default, or padding), so the transformer only ever sees a few shapes. Whatever is odd about an upload is
either normalised (and said so in `notes`) or refused with a one-line ValueError.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from neuron_ui.config.resolutions import parse_resolution, parse_resolutions

if TYPE_CHECKING:
    from neuron_ui.config.resolutions import Resolution


# Around 1 MP (klein's native reference size) and a cheaper ~0.25 MP set. Each set is a square and a 9:7
# pair: a pair's two orientations have the same token count, so they share one compiled graph. All are at
# most 1024*1024 pixels and multiples of 16, so diffusers hands them to the VAE unchanged.
REFERENCE_PRESETS = ("1024x1024", "1152x896", "896x1152", "512x512", "576x448", "448x576")
REFERENCE_SIZES = parse_resolutions(REFERENCE_PRESETS)  # the first is the default
FIT_MODES = ("crop", "pad")  # crop: fill the size, cut the overflow at the centre; pad: keep all, black bars
PAD_COLOR = (0, 0, 0)
ALPHA_BACKGROUND = (255, 255, 255)  # transparent pixels become white, as most viewers show them
MAX_UPLOAD_BYTES = 25 * 1024 * 1024
MAX_PIXELS = 40_000_000  # a decompression bomb is refused before it is decoded
ImageSource = Union[str, Path, bytes, Image.Image]


@dataclass(frozen=True)
class FittedImage:
    """One input as the model sees it, and what traces it back to the upload."""

    role: str  # "reference 1", "image", "mask"
    image: Image.Image  # RGB (a mask: L, 0 or 255) at exactly `size`
    size: Resolution
    source_size: tuple[int, int]  # width, height after EXIF orientation
    sha256: str  # of the uploaded file's bytes (of the decoded pixels for an in-memory image)
    fit: str
    notes: tuple[str, ...] = ()

    def meta(self) -> dict[str, Any]:
        """JSON-ready, for the result's info and the PNG metadata."""
        return {"role": self.role, "sha256": self.sha256, "fitted_size": str(self.size),
                "source_size": f"{self.source_size[0]}x{self.source_size[1]}", "fit": self.fit,
                "notes": list(self.notes)}


def validate_reference_size(size: object, allowed: tuple[Resolution, ...] = REFERENCE_SIZES) -> Resolution:
    names = ", ".join(map(str, allowed))
    if isinstance(size, str) and len(size) > 40:
        raise ValueError(f"reference size is not one of {names}")
    try:
        parsed = parse_resolution(size)
    except ValueError as error:
        raise ValueError(f"reference size: {error}; allowed: {names}") from None
    if parsed not in allowed:
        raise ValueError(f"reference size {parsed} is not one of {names}")
    return parsed


def validate_fit(fit: object) -> str:
    if fit not in FIT_MODES:
        raise ValueError(f"fit must be one of {', '.join(FIT_MODES)}, got {str(fit)[:20]!r}")
    return fit


def read_image(source: ImageSource, role: str) -> tuple[Image.Image, str, list[str]]:
    """Decode an upload fully: (image with EXIF orientation applied, sha256, notes); ValueError if it cannot be."""
    if isinstance(source, Image.Image):
        image = source.copy()
        digest = hashlib.sha256(image.tobytes()).hexdigest()
    else:
        data = _read_bytes(source, role)
        digest = hashlib.sha256(data).hexdigest()
        image = _decode(data, role)
    notes = []
    if getattr(image, "n_frames", 1) > 1:
        notes.append(f"{role}: animated ({image.n_frames} frames); the first frame is used")
        image.seek(0)
    image = ImageOps.exif_transpose(image)  # a phone photo's rotation lives in EXIF, not in its pixels
    return image, digest, notes


def _read_bytes(source: str | Path | bytes, role: str) -> bytes:
    if isinstance(source, bytes):
        data = source
    elif isinstance(source, (str, Path)):
        path = Path(source)
        try:
            size = path.stat().st_size
            if size > MAX_UPLOAD_BYTES:
                raise ValueError(f"{role} is {size / 2**20:.1f} MB; the limit is {MAX_UPLOAD_BYTES // 2**20} MB")
            data = path.read_bytes()
        except OSError:
            raise ValueError(f"{role}: the uploaded file cannot be read") from None
    else:
        raise ValueError(f"{role} must be an image file, got {type(source).__name__}")
    if len(data) > MAX_UPLOAD_BYTES:
        raise ValueError(f"{role} is {len(data) / 2**20:.1f} MB; the limit is {MAX_UPLOAD_BYTES // 2**20} MB")
    return data


def _decode(data: bytes, role: str) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise ValueError(f"{role} is {width}x{height} pixels; the limit is {MAX_PIXELS / 1e6:.0f} megapixels")
            image.load()
    except ValueError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ValueError(f"{role} is too many pixels; the limit is {MAX_PIXELS / 1e6:.0f} megapixels") from None
    except UnidentifiedImageError:
        raise ValueError(f"{role} is not an image (PNG, JPEG, WebP, GIF...)") from None
    except (OSError, SyntaxError, EOFError):
        raise ValueError(f"{role} is truncated or damaged: it cannot be decoded") from None
    return image


def to_rgb(image: Image.Image, role: str, notes: list[str]) -> Image.Image:
    """8-bit RGB whatever the upload's mode; each normalisation is told in `notes`."""
    mode = image.mode
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        notes.append(f"{role}: 16-bit image reduced to 8 bits")
        pixels = np.asarray(image, dtype=np.float64)
        top = 65535.0 if mode.startswith("I;16") or pixels.max() > 255 else 255.0
        image = Image.fromarray(np.clip(pixels / top * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    elif mode == "F":
        raise ValueError(f"{role} has floating-point pixels; save it as an 8-bit PNG or JPEG")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        notes.append(f"{role}: palette image converted to RGB")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        if rgba.getchannel("A").getextrema()[0] < 255:
            notes.append(f"{role}: transparent pixels filled with white")
        background = Image.new("RGBA", rgba.size, ALPHA_BACKGROUND + (255,))
        image = Image.alpha_composite(background, rgba)
    elif image.mode == "CMYK":
        notes.append(f"{role}: CMYK converted to RGB")
    return image.convert("RGB")


def fit_image(image: Image.Image, size: Resolution, fit: str, fill: Any = PAD_COLOR,
              resample: Image.Resampling = Image.Resampling.LANCZOS) -> Image.Image:
    """Exactly `size`: scale to cover and cut the centre (crop), or scale to fit inside and pad (pad)."""
    target = (size.width, size.height)
    if fit == "crop":
        return ImageOps.fit(image, target, resample, centering=(0.5, 0.5))
    return ImageOps.pad(image, target, resample, color=fill, centering=(0.5, 0.5))


def fit_reference(source: ImageSource, size: Resolution, fit: str = "crop", role: str = "reference") -> FittedImage:
    """One reference (or the image to inpaint) as the model will see it."""
    image, digest, notes = read_image(source, role)
    rgb = to_rgb(image, role, notes)
    return FittedImage(role, fit_image(rgb, size, fit), size, rgb.size, digest, fit, tuple(notes))


def fit_references(sources: list[ImageSource] | tuple[ImageSource, ...], size: Resolution, fit: str,
                   max_references: int) -> tuple[FittedImage, ...]:
    if len(sources) > max_references:
        raise ValueError(f"{len(sources)} reference images; this server takes at most {max_references}")
    return tuple(fit_reference(s, size, fit, f"reference {i}") for i, s in enumerate(sources, 1))


def fit_mask(source: ImageSource, image: FittedImage) -> FittedImage:
    """The mask, fitted exactly as its image was: white (or painted, where it has transparency) is redone."""
    mask, digest, notes = read_image(source, "mask")
    if mask.size != image.source_size:
        raise ValueError(f"mask is {mask.size[0]}x{mask.size[1]} but the image is "
                         f"{image.source_size[0]}x{image.source_size[1]}: paint the mask on the image itself")
    if mask.mode in ("RGBA", "LA", "PA") or (mask.mode == "P" and "transparency" in mask.info):
        alpha = mask.convert("RGBA").getchannel("A")
        painted = alpha if alpha.getextrema()[0] < 255 else to_rgb(mask, "mask", notes).convert("L")
    else:
        painted = to_rgb(mask, "mask", notes).convert("L")
    binary = painted.point(lambda v: 255 if v >= 128 else 0)
    if binary.getextrema()[1] == 0:
        raise ValueError("mask is empty: paint over the part of the image to redo")
    fitted = fit_image(binary, image.size, image.fit, fill=0, resample=Image.Resampling.NEAREST)
    return FittedImage("mask", fitted, image.size, mask.size, digest, image.fit, tuple(notes))
