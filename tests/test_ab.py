"""A/B: two images that differ in named settings, planned and refused on plain values, made through the grid's
runner on a recording engine (one request at a time), drawn side by side with labels and parameters; two PNGs
compared from their own parameters; the `ab` command in process. The API and MCP: tests/test_grid_api.py."""

from __future__ import annotations

import json
import struct
import zlib

import pytest
from fakes import Recorder
from PIL import Image

from neuron_ui import cli
from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.studio.ab import compare_files, plan_ab
from neuron_ui.contract.results import GenerateResult

PRESETS = parse_resolutions("256x256,384x256")
STYLES = {"ink": 0.8}
PROMPT = "a red fox in snow"


def plan(a, b, resolution="256x256"):
    return plan_ab(PROMPT, resolution, a, b, presets=PRESETS, loaded=STYLES, default_steps=4, seed=7)


def made_by(cell):
    return (cell.prompt, cell.seed, cell.steps, cell.style, cell.strength)


def test_b_is_a_with_its_settings_and_each_side_is_labelled_by_what_differs():
    seeds = plan("seed=3 steps=1", "seed=4")
    assert [made_by(c) for c in seeds.grid.cells] == [(PROMPT, 3, 1, None, None), (PROMPT, 4, 1, None, None)]
    assert seeds.differs == ("seed",) and seeds.grid.axes[0].labels == ("A: seed 3", "B: seed 4")
    styles = plan("style=ink strength=0.5", "style=none")
    assert [made_by(c) for c in styles.grid.cells] == [(PROMPT, 7, 4, "ink", 0.5), (PROMPT, 7, 4, None, None)]
    assert styles.grid.axes[0].labels == ("A: ink · strength 0.5", "B: no style")
    words = plan(None, "replace=fox,cat style=ink")  # a new style comes at its default strength
    assert made_by(words.grid.cells[1]) == ("a red cat in snow", 7, 4, "ink", 0.8)
    assert words.grid.axes[0].labels == ("A: fox · no style", "B: cat · ink · strength 0.8")
    whole = plan("seed=1", 'prompt="an owl at night" seed=2')
    assert whole.differs == ("prompt", "seed") and whole.grid.cells[1].prompt == "an owl at night"


@pytest.mark.parametrize("a, b, resolution, line", [
    ("seed=3", "seed=3", "256x256", "a and b make the same image: give b a setting that differs, e.g. b=\"seed=4\""),
    ("", "sead=3", "256x256", "b: 'sead' is not a setting; the settings are seed, steps, style, strength, prompt, "
                              "replace"),
    ("style=chalk", "seed=1", "256x256", "a: lora 'chalk' is not a style loaded here; allowed: none, ink"),
    ("", "seed=1", "512x512", "resolution 512x512 is not a preset; allowed: 256x256, 384x256"),
    ("", "strength=1", "256x256", "b: strength is a style's strength: set style too (e.g. style=ink strength=0.8)"),
    ("", "seed=3,4", "256x256", "b: seed takes one value, got '3,4'"),
    ("", "seed", "256x256", "b: 'seed' is not key=value, e.g. seed=3 style=ink"),
    # a line break anywhere in a side (shlex took one between pairs for a space, and one inside a pair for the end
    # of a word: "'3' is not key=value"), named as a grid's axis names it
    ("", "seed=3\nstyle=ink", "256x256", "b: the settings have a line break: give them on one line, space-separated, "
                                         "e.g. seed=3 style=ink"),
    ("seed=\n3", "seed=1", "256x256", "a: the settings have a line break: give them on one line, space-separated, "
                                      "e.g. seed=3 style=ink"),
    ("seed=3\r", "seed=1", "256x256", "a: the settings have a line break: give them on one line, space-separated, "
                                      "e.g. seed=3 style=ink"),
    ("", 'replace="fox,c\nat"', "256x256", "b: the settings have a line break: give them on one line, "
                                           "space-separated, e.g. seed=3 style=ink"),
])
def test_bad_settings_are_one_line(a, b, resolution, line):
    with pytest.raises(ValueError) as error:
        plan(a, b, resolution)
    assert str(error.value) == line


def saved(tmp_path, name, size=(256, 256), **fields):
    result = GenerateResult(Image.new("RGB", size, (90, 90, 90)), fields.get("prompt", PROMPT), f"{size[0]}x{size[1]}",
                            4, fields.get("seed", 1), None, "tiny", "eager", 0.0, 0.1, 0.1, lora=fields.get("lora"),
                            lora_scale=fields.get("lora_scale"))
    return result.save_png(tmp_path / name)


def test_two_pngs_are_compared_from_their_parameters(tmp_path):
    old = saved(tmp_path, "old.png", seed=1)
    new = saved(tmp_path, "new.png", size=(384, 256), seed=2, lora="ink", lora_scale=0.8)
    compared = compare_files(old, new)
    assert compared.info["differs"] == ["resolution", "seed", "style", "strength"]
    assert compared.info["labels"] == ["A: 256x256 · seed 1 · no style", "B: 384x256 · seed 2 · ink · strength 0.8"]
    assert compared.info["b"]["image"] == str(new) and compared.image.width > 2 * 256
    plain = tmp_path / "plain.png"
    Image.new("RGB", (64, 64)).save(plain)
    assert compare_files(old, plain).info["labels"] == ["A", "B"]
    with pytest.raises(ValueError, match="is not a regular file"):
        compare_files(old, tmp_path)


def test_the_ab_command_makes_or_compares_and_refuses_in_one_line(tmp_path, capsys, environ):
    engine = Recorder()
    common = ["ab", "--model", "tiny", "--compile", "eager", "--resolutions", "256x256,384x256", "--cache-dir",
              str(tmp_path / "cache")]
    code = cli.main([*common, "--prompt", PROMPT, "--resolution", "256x256", "--a", "seed=3", "--b", "replace=fox,cat",
                     "--out", str(tmp_path / "ab.png")], load=lambda settings: engine)
    info = json.loads(capsys.readouterr().out)
    assert code == 0 and info["labels"] == ["A: fox", "B: cat"] and info["out"] == str(tmp_path / "ab.png")
    assert info["b"]["image"] == str(tmp_path / "ab-B.png")
    assert Image.open(tmp_path / "ab-B.png").text["prompt"] == "a red cat in snow"
    code = cli.main([*common, str(tmp_path / "ab-A.png"), str(tmp_path / "ab-B.png"), "--out", str(tmp_path / "c.png")])
    assert code == 0 and json.loads(capsys.readouterr().out)["differs"] == ["prompt"]
    assert json.loads(Image.open(tmp_path / "c.png").text["ab"])["labels"] == ["A: fox", "B: cat"]
    code = cli.main([*common, "--prompt", PROMPT, "--resolution", "256x256", "--b", "style=chalk",
                     "--out", str(tmp_path / "bad.png")], load=lambda settings: engine)
    assert code == 2 and capsys.readouterr().err == "error: b: lora 'chalk' is not a style loaded here; allowed: " \
        "none, ink\n"
    assert len(engine.calls) == 2 and not (tmp_path / "bad.png").exists()  # nothing ran
    assert cli.main([*common, str(tmp_path / "ab-A.png")]) == 2
    assert capsys.readouterr().err.startswith("error: give two PNGs to compare, or --prompt, --resolution and --b")


def bomb(path, width=30000, height=30000):
    """A PNG that says it is width x height pixels: its header only (Pillow refuses such a size from it)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) +
                     chunk(b"IEND", b""))
    return path


def test_the_ab_command_with_two_pngs_refuses_a_bomb_and_a_folder_in_one_line(tmp_path, capsys, environ):
    """A 30000x30000 PNG and an --out that is a folder each printed a traceback."""
    common = ["ab", "--cache-dir", str(tmp_path / "cache")]
    old = saved(tmp_path, "old.png", seed=1)
    for argv, line in [
        ([str(bomb(tmp_path / "bomb.png")), str(old)], f"error: {tmp_path / 'bomb.png'} is too many pixels; the "
                                                        "limit is 40 megapixels"),
        ([str(old), str(old), "--out", str(tmp_path)], f"error: --out {tmp_path} is a folder: name the PNG to write, "
                                                       f"e.g. {tmp_path / 'out.png'}"),
        ([str(old), str(tmp_path)], f"error: PNG {tmp_path}: not a file"),
    ]:
        assert cli.main([*common, *argv]) == 2
        assert capsys.readouterr().err == line + "\n"


def test_a_b_of_another_shape_is_fitted_at_least_a_pixel_high(tmp_path, capsys, environ):
    """A 65000x1 B beside a 256x256 A was Pillow's "height and width must be > 0"."""
    Image.new("RGB", (65000, 1), (255, 0, 0)).save(tmp_path / "wide.png")
    old = saved(tmp_path, "old.png", seed=1)
    out = tmp_path / "ab.png"
    assert cli.main(["ab", "--cache-dir", str(tmp_path / "cache"), str(old), str(tmp_path / "wide.png"),
                     "--out", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["labels"] == ["A", "B"]
    sheet = Image.open(out).convert("RGB")
    assert (255, 0, 0) in {colour for _, colour in sheet.getcolors(1 << 16)}  # B's one row, drawn
