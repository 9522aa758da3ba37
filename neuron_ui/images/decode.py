"""Input images opened, read and decoded within bounds: bytes, pixels and how many are decoded at once; no torch.

Every input image (a reference, the image to inpaint, its mask, a layer painted in the editor) is read here. The
file's bytes are hashed as they stream in, never held whole, and refused past MAX_UPLOAD_BYTES while reading; the
header is checked (MAX_PIXELS) before any pixel is decoded; and decoding runs in DECODERS threads (`on_decoder`),
so many large uploads at once wait their turn here instead of holding gigabytes: 12 requests of two 39.7 MP 16-bit
PNGs (77 KB each on the wire) once took 8.6 GB (bench/decode_memory.py measures it). Each way a file can be bad gets
its own one-line ValueError. `open_regular` refuses what is not a regular file (a FIFO would hold the request
open, a device never ends), and the reader counts bytes as they come: stat() says 0 for a FIFO or a device.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import stat
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, ParamSpec, TypeVar

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

MAX_UPLOAD_BYTES = 25 * 1024 * 1024
MAX_PIXELS = 40_000_000  # a decompression bomb is refused before it is decoded
# Images decoded at once in the process. One takes at most about 9 bytes a pixel while it is decoded and made 8-bit
# (PIL keeps RGB and RGBA at 4 bytes a pixel: an RGBA upload is the source, its alpha and the white canvas it is laid
# on), so about 360 MB at MAX_PIXELS; a 16-bit grey one 3 bytes a pixel (the source and its 8-bit copy).
DECODERS = 2
DECODER_THREAD = "decoder"
ImageSource = str | Path | bytes | Image.Image
_decoders = ThreadPoolExecutor(max_workers=DECODERS, thread_name_prefix=DECODER_THREAD)
P = ParamSpec("P")
T = TypeVar("T")
_CHUNK = 1 << 20
_HEAD = 4096  # what is kept of a file's start to say what it is when it is not an image


@dataclass(frozen=True)
class UploadLimits:
    """What one input may cost: its file's bytes, and its pixels (checked from the header, before decoding)."""

    max_bytes: int = MAX_UPLOAD_BYTES
    max_pixels: int = MAX_PIXELS


LIMITS = UploadLimits()


def open_regular(path: str | Path, role: str,
                 refuse: Callable[[int], Exception] | None = None) -> BinaryIO:
    """The file opened for reading if it is a regular file; ValueError (one line) otherwise, or `refuse(st_mode)`
    for what is not a regular file (a bundle's own words; a bundle that cannot be opened is its OSError).

    O_NONBLOCK: opening a FIFO does not wait for a writer; fstat then refuses it, and any device, unread."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except (OSError, ValueError):
        if refuse is not None:
            raise
        raise ValueError(f"{role}: the uploaded file cannot be read (it may have expired: upload it again)") from None
    try:
        kind = os.fstat(fd).st_mode
        if not stat.S_ISREG(kind):
            raise refuse(kind) if refuse else ValueError(f"{role} is not a regular file: upload an image file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def on_decoder(fn: Callable[P, T]) -> Callable[P, T]:
    """Run `fn` (it decodes and fits an input) in one of the DECODERS threads, waiting for one to be free.

    At most DECODERS images are decoded at once, whoever sends them; and the allocator keeps what a thread freed in
    that thread's arena, so large images decoded in any of Gradio's many worker threads once left each holding its
    own hundreds of MB: decoding in a few threads keeps that to a few arenas too."""
    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> T:
        if threading.current_thread().name.startswith(DECODER_THREAD):
            return fn(*args, **kwargs)  # already on one (fit_mask inside a fit)
        return _decoders.submit(fn, *args, **kwargs).result()

    return run


def too_big(role: str, max_bytes: int = MAX_UPLOAD_BYTES) -> ValueError:
    return ValueError(f"{role} is larger than the {max_bytes / 2**20:g} MB limit for an upload")


def _hash_capped(file: BinaryIO, role: str, max_bytes: int) -> tuple[str, bytes]:
    """sha256 of the whole file and its first bytes, counting while reading (never stat()'s word for the size)."""
    digest, head, size = hashlib.sha256(), b"", 0
    while chunk := file.read(_CHUNK):
        size += len(chunk)
        if size > max_bytes:
            raise too_big(role, max_bytes)
        digest.update(chunk)
        head = head if len(head) >= _HEAD else (head + chunk)[:_HEAD]
    return digest.hexdigest(), head


def read_file(path: str | Path, role: str) -> bytes:
    """A file's bytes, read whole (to send to a replica on another node): a regular file, at most MAX_UPLOAD_BYTES
    counted while reading."""
    with open_regular(path, role) as file:
        data = file.read(MAX_UPLOAD_BYTES + 1)
    if len(data) > MAX_UPLOAD_BYTES:
        raise too_big(role)
    return data


def what_it_is(head: bytes, role: str) -> ValueError:
    """Why a file is not an image, as specifically as its first bytes tell."""
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if not head:
        return ValueError(f"{role} is an empty file (0 bytes): upload the image again")
    if text.startswith(b"%pdf"):
        return ValueError(f"{role} is a PDF document, not an image: export the page as PNG or JPEG")
    if b"<svg" in text and text.startswith((b"<?xml", b"<svg", b"<!--")):
        return ValueError(f"{role} is an SVG drawing, which is not read here: export it as PNG")
    return ValueError(f"{role} is not an image (PNG, JPEG, WebP, GIF...)")


def _open(file: BinaryIO, head: bytes, role: str, max_pixels: int, notes: list[str]) -> Image.Image:
    """The header first: format, mode and size, each checked before any pixel is decoded; then the pixels."""
    damaged = ValueError(f"{role} is truncated or damaged: it cannot be decoded")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # MAX_PIXELS below is stricter
            image = Image.open(file)
    except Image.DecompressionBombError:  # so many pixels that PIL will not even say how many
        raise ValueError(f"{role} is too many pixels; the limit is {max_pixels / 1e6:.0f} megapixels") from None
    except UnidentifiedImageError:
        raise what_it_is(head, role) from None
    except (OSError, SyntaxError, EOFError, ValueError):
        raise damaged from None
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"{role} is {width}x{height} pixels; the limit is {max_pixels / 1e6:.0f} megapixels")
    if width * height == 0:
        raise ValueError(f"{role} is {width}x{height} pixels: there is nothing in it")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            frames = getattr(image, "n_frames", 1)  # only a multi-frame format's images have it
            if frames > 1:
                notes.append(f"{role}: animated ({frames} frames); the first frame is used")
                image.seek(0)
            image.load()
            ImageOps.exif_transpose(image, in_place=True)  # a phone photo's rotation lives in EXIF, not its pixels
    except (OSError, SyntaxError, EOFError, ValueError, Image.DecompressionBombWarning):
        image.close()
        raise damaged from None
    return image


@contextmanager
def decoded(source: ImageSource, role: str, limits: UploadLimits = LIMITS
            ) -> Iterator[tuple[Image.Image, str, list[str]]]:
    """An input decoded, held until the block ends: (image with EXIF orientation applied, sha256 of its bytes (of
    its pixels for an in-memory image), notes); ValueError if it cannot be, or is over `limits`. Call it in a
    function run on_decoder."""
    notes: list[str] = []
    if isinstance(source, Image.Image):
        yield source.copy(), hashlib.sha256(source.tobytes()).hexdigest(), notes
        return
    if isinstance(source, (bytes, bytearray)):
        file: BinaryIO = io.BytesIO(source)  # counted as it is read, as a file is
    elif isinstance(source, (str, Path)):
        file = open_regular(source, role)
    else:
        raise ValueError(f"{role} must be an image file, got {type(source).__name__}")  # noqa: TRY004 - bad input
    with file:
        digest, head = _hash_capped(file, role, limits.max_bytes)
        file.seek(0)
        with _open(file, head, role, limits.max_pixels, notes) as image:
            yield image, digest, notes


def _scaled_to_8_bits(image: Image.Image, top: int) -> Image.Image:
    """An integer image (16- or 32-bit) as 8-bit L, 0..top onto 0..255 rounded, a band of rows at a time: no
    full-size wider copy (a float64 one was 8 bytes a pixel)."""
    width, height = image.size
    out = Image.new("L", image.size)
    band = max(1, (1 << 20) // max(width, 1))  # ~1 M pixels a band: a few MB of temporaries
    for y in range(0, height, band):
        rows = np.asarray(image.crop((0, y, width, min(height, y + band)))).astype(np.int64)
        np.clip(rows, 0, top, out=rows)
        rows *= 255
        rows += top // 2
        rows //= top
        out.paste(Image.fromarray(rows.astype(np.uint8), "L"), (0, y))
    return out


def band_range(image: Image.Image) -> tuple[float, float]:
    """The lowest and highest value of a one-band image (an alpha channel, a mask, an "I" image); PIL's
    getextrema answers a pair per band for an image of several."""
    low, high = image.getextrema()
    if isinstance(low, tuple) or isinstance(high, tuple):
        raise ValueError(f"expected one band, got a {image.mode} image")
    return low, high


def to_8bit(image: Image.Image, role: str, notes: list[str]) -> Image.Image:
    """8-bit L (grey uploads stay grey, a third of RGB's memory) or RGB whatever the upload's mode; each
    normalisation is told in `notes`."""
    mode = image.mode
    if mode.startswith("I;16"):
        notes.append(f"{role}: 16-bit image reduced to 8 bits")
        return _scaled_to_8_bits(image, 65535)
    if mode == "I":  # 32-bit integers: a TIFF, or an old reader's 16-bit PNG
        high = band_range(image)[1]
        top = 255 if high <= 255 else 65535 if high <= 65535 else int(high)
        notes.append(f"{role}: 32-bit integer image reduced to 8 bits")
        return _scaled_to_8_bits(image, top)
    if mode == "F":
        raise ValueError(f"{role} has floating-point pixels; save it as an 8-bit PNG or JPEG")
    if mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        notes.append(f"{role}: palette image converted to RGB")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        alpha = rgba.getchannel("A")
        if band_range(alpha)[0] < 255:
            notes.append(f"{role}: transparent pixels filled with white")
        canvas = Image.new("RGB", rgba.size, (255, 255, 255))  # transparent pixels become white, as viewers show
        canvas.paste(rgba, mask=alpha)
        return canvas
    if image.mode == "1":
        return image.convert("L")
    if image.mode == "CMYK":
        notes.append(f"{role}: CMYK converted to RGB")
    return image if image.mode in ("L", "RGB") else image.convert("RGB")
