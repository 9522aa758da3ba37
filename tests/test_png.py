"""The PNG the app serves (issue 22, the round trip): written uncompressed for speed, the same pixels and the same
parameters as PIL's encoder writes; no model needed."""

import json
import zlib

import numpy as np
import pytest
from PIL import Image

from neuron_ui.images.png import stored_deflate, write_png
from neuron_ui.contract.results import GenerateResult
from neuron_ui.web.files import ImageStore


def result(image: Image.Image, prompt: str = "a fox\tat dusk, 🦊 عربى") -> GenerateResult:
    return GenerateResult(image=image, prompt=prompt, resolution=f"{image.width}x{image.height}", steps=4, seed=7,
                          guidance=None, model="tiny", cache_event="memory_hit", compile_seconds=0.0,
                          run_seconds=0.5, total_seconds=0.6, lora="ink", lora_scale=0.8, lora_sha256="ab" * 32)


def noise(mode: str, size=(96, 64)) -> Image.Image:
    channels = {"L": 1, "RGB": 3, "RGBA": 4}[mode]
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


def idat(path) -> bytes:
    data, at = path.read_bytes(), 8
    found = b""
    while at < len(data):
        length = int.from_bytes(data[at:at + 4], "big")
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        assert zlib.crc32(body, zlib.crc32(kind)) == int.from_bytes(data[at + 8 + length:at + 12 + length], "big")
        found += body if kind == b"IDAT" else b""
        at += length + 12
    return found


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_the_fast_png_has_the_pixels_and_the_text_that_pil_writes(tmp_path, mode):
    made = result(noise(mode))
    fast, slow = made.save_png(tmp_path / "fast.png", fast=True), made.save_png(tmp_path / "slow.png")
    with Image.open(fast) as ours, Image.open(slow) as pils:
        assert ours.mode == pils.mode == mode and ours.size == pils.size
        assert np.array_equal(np.asarray(ours), np.asarray(pils))
        assert ours.text == pils.text  # tEXt and, for the prompt with emoji and Arabic, iTXt
    parameters = json.loads(Image.open(fast).text["parameters"])
    assert parameters["prompt"] == made.prompt and parameters["seed"] == 7 and parameters["lora"] == "ink"


def test_other_modes_are_written_as_rgb(tmp_path):
    palette = noise("RGB").convert("P")
    path = write_png(palette, tmp_path / "p.png", [("k", "v")])
    with Image.open(path) as back:
        assert back.mode == "RGB" and np.array_equal(np.asarray(back), np.asarray(palette.convert("RGB")))
        assert back.text == {"k": "v"}


def test_the_image_store_writes_the_png_a_user_waits_on_uncompressed(tmp_path):
    """Not deflated: every row stored as it is (filter 0), so no encoder work is on the round trip's path."""
    image = Image.new("RGB", (128, 64), (10, 200, 30))  # one colour: any deflate would shrink it to a few bytes
    path = ImageStore(tmp_path / "images").save(result(image))
    raw = zlib.decompress(idat(tmp_path / "images" / path.rsplit("/", 1)[1]))
    assert len(raw) == 64 * (1 + 128 * 3) and raw[::1 + 128 * 3] == bytes(64)  # every row: filter type 0
    assert len(idat(tmp_path / "images" / path.rsplit("/", 1)[1])) > len(raw)  # stored blocks, not compressed
    with Image.open(path) as back:
        assert back.getpixel((5, 5)) == (10, 200, 30) and json.loads(back.text["parameters"])["seed"] == 7


@pytest.mark.parametrize("size", [1, 0xFFFF - 1, 0xFFFF, 0xFFFF + 1, 3 * 0xFFFF + 17])
def test_stored_deflate_is_a_zlib_stream_of_the_bytes_across_block_edges(size):
    """Written in pieces that point into the pixels (no copy); zlib reads them back, its checksum included."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    pieces = stored_deflate(memoryview(data))
    assert zlib.decompress(b"".join(pieces)) == data
    assert sum(isinstance(piece, memoryview) for piece in pieces) == -(-size // 0xFFFF)  # the blocks: views


def test_a_1024_square_png_is_read_back_by_pil_with_every_crc_checked(tmp_path):
    image = noise("RGB", size=(1024, 1024))
    path = write_png(image, tmp_path / "big.png", [("parameters", "{}")])
    assert zlib.decompress(idat(path))[1:1 + 3 * 1024] == np.asarray(image)[0].tobytes()
    with Image.open(path) as back:
        assert np.array_equal(np.asarray(back), np.asarray(image))
