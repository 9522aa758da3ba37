"""Editing through gradio_client: references on /generate, and /inpaint, against app.py's app on the tiny model."""

import hashlib
import json

import numpy as np
import pytest
from gradio_client import handle_file
from gradio_client.exceptions import AppError
from PIL import Image
from serving import call, connect, served


def noise_file(folder, name: str, width: int, height: int, seed: int = 0) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    path = folder / name
    Image.fromarray(pixels, "RGB").save(path)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tmp_path_factory.mktemp("cache")) as s:
        client = connect(s.url, tmp_path_factory.mktemp("downloads"))
        yield s.engine, client, tmp_path_factory.mktemp("inputs")
        client.close()


def test_generate_with_references_compiles_once_then_hits(server):
    engine, client, folder = server
    first = noise_file(folder, "a.png", 700, 300)
    refs = [handle_file(first), handle_file(noise_file(folder, "b.png", 64, 900, 1))]
    path, info = call(client, "this, at night", "256x256", 2, 5, None, refs, "512x512")
    assert info["cache_event"] == "compiled" and info["tokens"] == 256 + 2 * 1024
    assert [i["fitted_size"] for i in info["inputs"]] == ["512x512", "512x512"]
    params = json.loads(Image.open(path).text["parameters"])
    assert params["inputs"][0]["sha256"] == hashlib.sha256(open(first, "rb").read()).hexdigest()
    assert params["inputs"][0]["source_size"] == "700x300"

    other = [handle_file(noise_file(folder, f"c{i}.png", 333 + i, 517, i + 2)) for i in range(2)]
    _, again = call(client, "another prompt", "256x256", 2, 6, None, other, "512x512")
    assert again["cache_event"] == "memory_hit"
    layouts = {s["layout"]: s for s in call(client, api_name="/status")["layouts"]}
    assert layouts["256x256 + 2 refs 512x512"]["state"] == "ready"


def test_inpaint_endpoint(server):
    _, client, folder = server
    image = noise_file(folder, "photo.png", 300, 200, 3)
    mask = folder / "mask.png"
    canvas = Image.new("L", (300, 200), 0)
    canvas.paste(255, (0, 0, 150, 200))
    canvas.save(mask)
    path, info = call(client, handle_file(image), handle_file(str(mask)), "a red door", 0.8, "256x256", 2, 9,
                      api_name="/inpaint")
    assert info["mode"] == "inpaint" and info["strength"] == 0.8 and info["tokens"] == 512
    assert Image.open(path).size == (256, 256) and info["cache_event"] in ("compiled", "memory_hit")
    _, again = call(client, handle_file(image), handle_file(str(mask)), "a blue door", 1.0, "256x256", 2, 10,
                    api_name="/inpaint")
    assert again["cache_event"] == "memory_hit"


def test_bad_inputs_are_one_line_errors(server):
    _, client, folder = server
    image = noise_file(folder, "img.png", 128, 128)
    text = folder / "notes.txt"
    text.write_text("not an image")
    small_mask = folder / "small.png"
    Image.new("L", (64, 64), 255).save(small_mask)
    cases = [
        ((handle_file(image), handle_file(str(small_mask)), "x", 0.8, "256x256", 1, 1), "/inpaint",
         "mask is 64x64 but the image is 128x128"),
        ((handle_file(str(text)), handle_file(str(small_mask)), "x", 0.8, "256x256", 1, 1), "/inpaint",
         "image is not an image"),
        (("x", "256x256", 1, 1, None, [handle_file(image)] * 3, "512x512"), "/generate", "at most 2"),
        (("x", "256x256", 1, 1, None, [handle_file(image)], "999x999"), "/generate", "reference size"),
    ]
    for args, api_name, message in cases:
        with pytest.raises(AppError, match=message):
            call(client, *args, api_name=api_name)
