"""PNG files written for speed: the pixels stored as they are (no row filters, no compression), with text chunks.

Every image the app serves waits for its PNG: the gradio_client round trip and the browser's image both fetch the
file only once it is written. PIL's encoder picks a row filter for every line and deflates even at zlib level 0;
at 1024x1024 it took most of what a round trip added over the plain pipeline call (docs/performance.md). Here the
rows are copied into stored deflate blocks: a valid PNG any reader opens, with the same text chunks as PIL writes
(tEXt, or iTXt when the text is not Latin-1), a few milliseconds to write, about as big as the raw pixels.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

SIGNATURE = b"\x89PNG\r\n\x1a\n"
COLOR_TYPES = {"L": 0, "RGB": 2, "RGBA": 6}  # 8 bits per sample each; other modes are made RGB first
MAX_STORED_BLOCK = 0xFFFF  # bytes in one stored deflate block (its length is 16 bits)


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)))


def text_chunk(key: str, value: str) -> bytes:
    """tEXt when key and value are Latin-1, else iTXt (UTF-8), as PIL's PngInfo.add_text chooses."""
    try:
        return chunk(b"tEXt", key.encode("latin-1") + b"\0" + value.encode("latin-1"))
    except UnicodeEncodeError:
        return chunk(b"iTXt", key.encode("utf-8") + b"\0\0\0\0\0" + value.encode("utf-8"))


def stored_deflate(data: memoryview) -> list[bytes | memoryview]:
    """`data` as a zlib stream of stored (uncompressed) deflate blocks, in pieces that point into `data`: what
    zlib.compress(data, 0) makes, without copying the megabytes into a new buffer first."""
    pieces: list[bytes | memoryview] = [b"\x78\x01"]  # zlib header: deflate, 32K window, no dictionary
    for start in range(0, len(data), MAX_STORED_BLOCK):
        block = data[start:start + MAX_STORED_BLOCK]
        final = start + MAX_STORED_BLOCK >= len(data)
        pieces += [struct.pack("<BHH", final, len(block), 0xFFFF ^ len(block)), block]
    pieces.append(struct.pack(">I", zlib.adler32(data)))
    return pieces


def write_png(image: Image.Image, path: Path | str, text: list[tuple[str, str]]) -> Path:
    """`image` as an uncompressed PNG at `path`, with `text` as its text chunks (before the pixels)."""
    if image.mode not in COLOR_TYPES:
        image = image.convert("RGB")
    width, height = image.size
    pixels = np.asarray(image, dtype=np.uint8).reshape(height, -1)
    rows = np.empty((height, pixels.shape[1] + 1), dtype=np.uint8)  # each row: filter type 0 (none), its bytes
    rows[:, 0] = 0
    rows[:, 1:] = pixels
    header = struct.pack(">IIBBBBB", width, height, 8, COLOR_TYPES[image.mode], 0, 0, 0)
    # numpy's stubs give ndarray no __buffer__ for Python < 3.12 (mypy's python_version is 3.10): it has one.
    idat = stored_deflate(memoryview(rows).cast("B"))  # type: ignore[arg-type]
    crc = zlib.crc32(b"IDAT")
    for piece in idat:
        crc = zlib.crc32(piece, crc)
    path = Path(path)
    with path.open("wb") as out:
        out.write(SIGNATURE + chunk(b"IHDR", header) + b"".join(text_chunk(k, v) for k, v in text))
        out.write(struct.pack(">I", sum(len(piece) for piece in idat)) + b"IDAT")
        out.writelines(idat)
        out.write(struct.pack(">I", crc) + chunk(b"IEND", b""))
    return path
