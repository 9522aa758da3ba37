"""Input images for editing (references, the image to inpaint, its mask), fitted to fixed sizes; no torch.

diffusers resizes a reference to at most 1 MP and floors it to a multiple of 16, so every upload size would be a
new sequence length, and on Neuron a new compilation. Here every input is fitted to a preset first (centre crop
by default, or padding), so the transformer only ever sees a few shapes. Whatever is odd about an upload is
either normalised (and said so in `notes`) or refused with a one-line ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from PIL import Image, ImageOps

from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.contract.checks import check_size
from neuron_ui.images.decode import LIMITS, ImageSource, UploadLimits, band_range, decoded, on_decoder, to_8bit

if TYPE_CHECKING:
    from collections.abc import Sequence

    from neuron_ui.config.resolutions import Resolution


# Around 1 MP (klein's native reference size) and a cheaper ~0.25 MP set. Each set is a square and a 9:7
# pair: a pair's two orientations have the same token count, so they share one compiled graph. All are at
# most 1024*1024 pixels and multiples of 16, so diffusers hands them to the VAE unchanged.
REFERENCE_PRESETS = ("1024x1024", "1152x896", "896x1152", "512x512", "576x448", "448x576")
REFERENCE_SIZES = parse_resolutions(REFERENCE_PRESETS)  # the first is the default
FIT_MODES = ("crop", "pad")  # crop: fill the size, cut the overflow at the centre; pad: keep all, black bars
PAD_COLOR = (0, 0, 0)


class InputMeta(TypedDict):
    """What a result (GenerateResult.inputs) and its PNG record of one input."""

    role: str
    sha256: str
    fitted_size: str
    source_size: str  # "WxH"
    fit: str
    notes: list[str]


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

    def meta(self) -> InputMeta:
        """JSON-ready, for the result's info and the PNG metadata."""
        return {"role": self.role, "sha256": self.sha256, "fitted_size": str(self.size),
                "source_size": f"{self.source_size[0]}x{self.source_size[1]}", "fit": self.fit,
                "notes": list(self.notes)}


def validate_reference_size(size: object, allowed: tuple[Resolution, ...] = REFERENCE_SIZES) -> Resolution:
    return check_size(size, allowed, long="reference size is not one of {allowed}",
                      unparsed="reference size: {error}; allowed: {allowed}",
                      outside="reference size {size} is not one of {allowed}")


def validate_fit(fit: object) -> str:
    if fit not in FIT_MODES:
        raise ValueError(f"fit must be one of {', '.join(FIT_MODES)}, got {str(fit)[:20]!r}")
    return fit


def fit_image(image: Image.Image, size: Resolution, fit: str, fill: int | tuple[int, int, int] = PAD_COLOR,
              resample: Image.Resampling = Image.Resampling.LANCZOS) -> Image.Image:
    """Exactly `size`: scale to cover and cut the centre (crop), or scale to fit inside and pad (pad)."""
    target = (size.width, size.height)
    if fit == "crop":
        return ImageOps.fit(image, target, resample, centering=(0.5, 0.5))
    if image.mode == "L" and isinstance(fill, tuple):
        fill = fill[0]  # a grey upload is fitted grey (PAD_COLOR is black), then made RGB
    return ImageOps.pad(image, target, resample, color=fill, centering=(0.5, 0.5))


@on_decoder
def fit_reference(source: ImageSource, size: Resolution, fit: str = "crop", role: str = "reference",
                  limits: UploadLimits = LIMITS) -> FittedImage:
    """One reference (or the image to inpaint) as the model will see it; decoded in one of the decoding threads,
    fitted before it is made RGB (a grey upload stays a third of the size until it is small)."""
    with decoded(source, role, limits) as (image, digest, notes):
        normal = to_8bit(image, role, notes)
        fitted = fit_image(normal, size, fit).convert("RGB")
    return FittedImage(role, fitted, size, normal.size, digest, fit, tuple(notes))


def fit_references(sources: Sequence[ImageSource], size: Resolution, fit: str,
                   max_references: int) -> tuple[FittedImage, ...]:
    if len(sources) > max_references:
        raise ValueError(f"{len(sources)} reference images; this server takes at most {max_references}")
    return tuple(fit_reference(s, size, fit, f"reference {i}") for i, s in enumerate(sources, 1))


@on_decoder
def fit_mask(source: ImageSource, image: FittedImage) -> FittedImage:
    """The mask, fitted exactly as its image was: white (or painted, where it has transparency) is redone."""
    with decoded(source, "mask") as (mask, digest, notes):
        if mask.size != image.source_size:
            raise ValueError(f"mask is {mask.size[0]}x{mask.size[1]} but the image is "
                             f"{image.source_size[0]}x{image.source_size[1]}: paint the mask on the image itself")
        painted = painted_part(mask, notes)
        if band_range(painted)[1] == 0:
            raise ValueError("mask is empty: paint over the part of the image to redo")
        fitted = fit_image(painted, image.size, image.fit, fill=0, resample=Image.Resampling.NEAREST)
    return FittedImage("mask", fitted, image.size, mask.size, digest, image.fit, tuple(notes))


def painted_part(mask: Image.Image, notes: list[str], role: str = "mask") -> Image.Image:
    """L, 255 where painted: the transparency where the mask has some, else its white (at least half-bright)."""
    if mask.mode in ("RGBA", "LA", "PA") or (mask.mode == "P" and "transparency" in mask.info):
        alpha = mask.getchannel("A") if mask.mode in ("RGBA", "LA") else mask.convert("RGBA").getchannel("A")
        if band_range(alpha)[0] < 255:
            return alpha.point(lambda v: 255 if v >= 128 else 0)
    return to_8bit(mask, role, notes).convert("L").point(lambda v: 255 if v >= 128 else 0)
