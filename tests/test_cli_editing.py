"""`python -m neuron_ui generate` with --reference, --image and --mask, in this process on the tiny model."""

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from neuron_ui import cli


@pytest.fixture
def run(tmp_path, capsys):
    saved = dict(os.environ)

    def run(*argv: str, load=None) -> tuple[int, str, str]:
        torch._dynamo.reset()
        code = cli.main(["generate", "--model", "tiny", "--compile", "eager", "--resolutions", "256x256",
                         "--cache-dir", str(tmp_path / "cache"), "--prompt", "a heron", "--resolution", "256x256",
                         "--steps", "1", "--seed", "3", *argv], load=load)
        out, err = capsys.readouterr()
        return code, out, err

    yield run
    os.environ.clear()
    os.environ.update(saved)


def picture(path, width, height, seed=0):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(path)
    return str(path)


def test_references_and_inpaint_from_the_command_line(run, tmp_path):
    a, b = picture(tmp_path / "a.png", 640, 480), picture(tmp_path / "b.jpg", 100, 300, 1)
    code, out, _ = run("--reference", a, "--reference", b, "--reference-size", "512x512",
                       "--out", str(tmp_path / "refs.png"))
    info = json.loads(out)
    assert code == 0 and info["tokens"] == 256 + 2 * 1024
    assert [i["source_size"] for i in info["inputs"]] == ["640x480", "100x300"]
    assert json.loads(Image.open(tmp_path / "refs.png").text["parameters"])["inputs"][1]["fitted_size"] == "512x512"

    mask = tmp_path / "mask.png"
    Image.new("L", (640, 480), 255).save(mask)
    code, out, _ = run("--image", a, "--mask", str(mask), "--strength", "0.5", "--out", str(tmp_path / "inp.png"))
    info = json.loads(out)
    assert code == 0 and info["mode"] == "inpaint" and info["strength"] == 0.5
    assert Image.open(tmp_path / "inp.png").size == (256, 256)


def test_bad_editing_input_exits_2_with_one_line(run, tmp_path):
    code, out, err = run("--mask", picture(tmp_path / "m.png", 64, 64))
    assert code == 2 and out == "" and "error: inpainting needs both an image and a mask" in err
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    code, _, err = run("--reference", str(tmp_path / "bad.png"))
    assert code == 2 and "error: reference 1 is" in err


def test_missing_files_are_named_before_the_model_loads(run, tmp_path):
    """Issue 22, item 13: a missing --reference was "the uploaded file cannot be read", after the model loaded."""

    def no_load(settings):
        raise AssertionError("the model was loaded before the files were checked")

    good = picture(tmp_path / "a.png", 64, 64)
    missing = str(tmp_path / "no-such-photo.jpg")
    code, out, err = run("--reference", good, "--reference", missing, load=no_load)
    assert code == 2 and out == "" and err.strip().splitlines()[-1] == f"error: --reference {missing}: no such file"
    code, _, err = run("--image", str(tmp_path), "--mask", good, load=no_load)
    assert code == 2 and f"error: --image {tmp_path}: not a file" in err
    code, _, err = run("--image", good, "--mask", missing, load=no_load)
    assert code == 2 and f"error: --mask {missing}: no such file" in err
    code, _, err = run("--out", str(tmp_path / "nowhere" / "out.png"), load=no_load)
    assert code == 2 and f"the folder {tmp_path / 'nowhere'} does not exist" in err
