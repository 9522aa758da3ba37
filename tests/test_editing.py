"""Editing on static shapes: references fitted to fixed sizes, inpainting through from_pipe, graphs by total sequence.

The tiny model's VAE has a real encoder, so references and inpainting run the real diffusers code paths; the
eager backend makes dynamo trace and count graphs for real.
"""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from runners import local_engine

from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.compile.counters import read_counters
from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.resolutions import parse_resolution, parse_resolutions
from neuron_ui.images.decode import UploadLimits
from neuron_ui.contract import references as refs
from neuron_ui.contract.layouts import Layout
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.model.loading import LoadedModel
from neuron_ui.model.runner import build_inpaint_pipeline
from neuron_ui.model.tiny import build_tiny_pipeline

REF_SIZES = "256x256,384x256,256x384"


def png(image: Image.Image, **save) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=save.pop("format", "PNG"), **save)
    return buffer.getvalue()


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One regional/eager engine for the graph-counting tests of this module, in order."""
    torch._dynamo.reset()
    cache = configure_cache_env(tmp_path_factory.mktemp("cache"), environ={})
    engine = local_engine(LoadedModel(build_tiny_pipeline(), name="tiny", is_tiny=True),
                          presets=parse_resolutions("256x256,512x512"), compile_mode="regional", backend="eager",
                          cache=cache, manifest=CacheManifest(cache.manifest),
                          reference_sizes=parse_resolutions(REF_SIZES))
    yield engine
    torch._dynamo.reset()


def gen(engine, prompt="a lighthouse", resolution="256x256", **kw):
    return engine.generate(GenerateRequest(prompt, resolution, steps=2, seed=7, **kw))


def graphs(before) -> int:
    return read_counters().graphs - before.graphs


# -- fitting ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("upload", [(100, 300), (4000, 100), (640, 480), (256, 256), (17, 1999)])
@pytest.mark.parametrize("fit", refs.FIT_MODES)
def test_fitted_image_has_the_preset_size_for_any_upload(upload, fit):
    size = parse_resolution("576x448")
    fitted = refs.fit_reference(png(noise(*upload)), size, fit)
    assert fitted.image.size == (576, 448) and fitted.image.mode == "RGB"
    assert fitted.source_size == upload and fitted.size == size and len(fitted.sha256) == 64


def test_exif_orientation_is_applied_before_fitting():
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display": a portrait photo stored landscape
    fitted = refs.fit_reference(png(noise(640, 480), format="JPEG", exif=exif), parse_resolution("448x576"))
    assert fitted.source_size == (480, 640) and fitted.image.size == (448, 576)


def test_pad_keeps_the_whole_image_with_bars():
    fitted = refs.fit_reference(png(Image.new("RGB", (400, 100), "white")), parse_resolution("512x512"), "pad")
    pixels = np.asarray(fitted.image)
    assert pixels[0, 0].tolist() == [0, 0, 0] and pixels[256, 256].tolist() == [255, 255, 255]


def test_meta_traces_the_input():
    data = png(noise(300, 200))
    meta = refs.fit_reference(data, parse_resolution("512x512")).meta()
    import hashlib

    assert meta["sha256"] == hashlib.sha256(data).hexdigest()
    assert meta["fitted_size"] == "512x512" and meta["source_size"] == "300x200"


# -- bad input: a one-line error, or a normalisation that is said -------------------------------------------


def refused(source, match: str, **kw) -> None:
    with pytest.raises(ValueError, match=match) as caught:
        refs.fit_reference(source, parse_resolution("512x512"), **kw)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("data, line", [
    (b"plain text, no image", "reference is not an image \\(PNG, JPEG"),
    (b"%PDF-1.4 not an image at all", "reference is a PDF document, not an image: export the page as PNG"),
    (b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg"/>', "reference is an SVG drawing"),
    (b"", "reference is an empty file \\(0 bytes\\)"),
])
def test_not_an_image_says_what_it_is(data, line):
    refused(data, line)


def test_truncated_image():
    refused(png(noise(300, 300))[:2000], "truncated or damaged")


def test_decompression_bomb():
    refused(png(Image.new("1", (2000, 1000))), "2000x1000 pixels; the limit is 1 megapixels",
            limits=UploadLimits(max_pixels=1_000_000))


def test_pil_bomb_error_is_refused_too(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100_000)  # PIL raises past twice this, warns past it
    refused(png(Image.new("1", (1000, 1000))), "too many pixels")


def test_upload_over_the_size_limit(tmp_path):
    path = tmp_path / "big.png"
    path.write_bytes(png(noise(200, 200)))
    refused(str(path), "larger than the .* MB limit", limits=UploadLimits(max_bytes=1000))
    refused(path.read_bytes(), "larger than the .* MB limit", limits=UploadLimits(max_bytes=1000))


def test_missing_file_and_wrong_type():
    refused("/nonexistent/photo.png", "cannot be read")
    refused(12, "must be an image file")


@pytest.mark.parametrize("make, note", [
    (lambda: png(Image.new("CMYK", (100, 80), (0, 255, 0, 0)), format="JPEG"), "CMYK converted"),
    (lambda: png(Image.fromarray(np.full((80, 100), 65535, np.uint16))), "16-bit"),
    (lambda: png(noise(100, 80).convert("P")), "palette"),
    (lambda: png(Image.new("RGBA", (100, 80), (255, 0, 0, 0))), "transparent pixels filled with white"),
])
def test_odd_modes_are_normalised_to_rgb_and_said(make, note):
    fitted = refs.fit_reference(make(), parse_resolution("512x512"))
    assert fitted.image.mode == "RGB" and fitted.image.size == (512, 512)
    assert any(note in n for n in fitted.notes), fitted.notes


def test_sixteen_bit_white_stays_white_and_alpha_becomes_white():
    white16 = refs.fit_reference(png(Image.fromarray(np.full((80, 100), 65535, np.uint16))),
                                 parse_resolution("256x256"))
    clear = refs.fit_reference(png(Image.new("RGBA", (100, 80), (255, 0, 0, 0))), parse_resolution("256x256"))
    assert np.asarray(white16.image).min() == 255 and np.asarray(clear.image).min() == 255


def test_animated_image_uses_its_first_frame_and_says_so():
    frames = [Image.new("RGB", (64, 64), c) for c in ("red", "blue")]
    data = png(frames[0], format="GIF", save_all=True, append_images=frames[1:])
    fitted = refs.fit_reference(data, parse_resolution("256x256"))
    assert "first frame" in fitted.notes[0]
    assert np.asarray(fitted.image)[128, 128].tolist() == [255, 0, 0]


def test_too_many_references():
    with pytest.raises(ValueError, match="3 reference images; this server takes at most 2"):
        refs.fit_references([png(noise(64, 64))] * 3, parse_resolution("256x256"), "crop", 2)


def test_mask_must_match_the_image_and_not_be_empty():
    image = refs.fit_reference(png(noise(300, 200)), parse_resolution("256x256"), role="image")
    with pytest.raises(ValueError, match="mask is 200x300 but the image is 300x200"):
        refs.fit_mask(png(Image.new("L", (200, 300), 255)), image)
    with pytest.raises(ValueError, match="mask is empty"):
        refs.fit_mask(png(Image.new("L", (300, 200), 0)), image)


def test_painted_layer_with_alpha_is_the_mask():
    image = refs.fit_reference(png(noise(256, 256)), parse_resolution("256x256"), role="image")
    layer = Image.new("RGBA", (256, 256), (0, 0, 0, 0))
    layer.paste((40, 40, 40, 255), (0, 0, 128, 256))  # a dark stroke: its alpha, not its colour, is the mask
    mask = np.asarray(refs.fit_mask(png(layer), image).image)
    assert mask[:, :128].min() == 255 and mask[:, 128:].max() == 0


def test_reference_presets_reach_the_vae_unchanged():
    """diffusers resizes above 1 MP and floors to 16: each preset must pass both untouched."""
    for size in refs.REFERENCE_SIZES:
        assert size.width * size.height <= 1024 * 1024 and size.width % 16 == 0 and size.height % 16 == 0


# -- the engine: graphs by total sequence length --------------------------------------------------------------


def test_references_compile_once_per_total_sequence_then_hit(engine):
    gen(engine)  # the output size's own graph, and how many graphs one compilation makes
    before = read_counters()
    gen(engine, resolution="512x512")
    per_compile = graphs(before)
    assert per_compile > 0

    # (reference size, count) -> total tokens with a 256x256 output (256 tokens).
    for size, count, total in (("256x256", 1, 512), ("384x256", 1, 640), ("256x256", 2, 768)):
        before = read_counters()
        result = gen(engine, references=[png(noise(300, 200, count))] * count, reference_size=size)
        assert result.cache_event == "compiled" and result.tokens == total
        assert graphs(before) == per_compile
        assert [i["fitted_size"] for i in result.inputs] == [size] * count

    # 2 x 384x256 at 256x256 is 1024 tokens: the graph 512x512 already compiled.
    status = engine.layout_status(engine.layout("256x256", 2, "384x256"))
    assert status.state == "ready" and status.shares_graph_with == "512x512" and status.tokens == 1024
    with torch.compiler.set_stance("fail_on_recompile"):
        shared = gen(engine, references=[png(noise(50, 900)), png(noise(900, 50))], reference_size="384x256")
        assert shared.cache_event == "memory_hit"
        # The transposed size has the same tokens: the same graph.
        assert gen(engine, references=[png(noise(64, 64))], reference_size="256x384").cache_event == "memory_hit"
        # Only the pixels, their upload size or orientation, or the prompt change: no new graph.
        for seed, upload in enumerate([(1000, 700), (70, 90), (333, 4000), (256, 256)]):
            again = gen(engine, prompt=f"prompt {seed}", references=[png(noise(*upload, seed))],
                        reference_size="256x256")
            assert again.cache_event == "memory_hit"


def test_status_lists_each_layout_used(engine):
    layouts = {s.layout: s for s in engine.status().layouts}
    assert layouts["256x256 + 1 ref 256x256"].state == "ready"
    assert layouts["256x256 + 2 refs 256x256"].tokens == 768
    assert engine.status().max_references == 2 and engine.status().reference_sizes == REF_SIZES.split(",")


def test_inpaint_adds_exactly_the_graph_the_status_promised(engine):
    """klein's inpaint pipeline appends the source image's latents: at 512x512 the transformer sees 2 x 1024."""
    layout = engine.layout("512x512", inpaint=True)
    promised = engine.layout_status(layout)
    assert promised.state == "cold" and promised.tokens == 2048 and promised.layout == "inpaint 512x512"
    before = read_counters()
    gen(engine, resolution="256x256")  # reference count for one compilation
    image = png(noise(700, 500, 1))
    mask = Image.new("L", (700, 500), 0)
    mask.paste(255, (0, 0, 350, 500))
    first = engine.inpaint(GenerateRequest("a red door", "512x512", steps=2, seed=1, image=image, mask=png(mask),
                                           strength=0.9))
    assert first.cache_event == "compiled" and first.tokens == 2048 and first.mode == "inpaint"
    assert first.image.size == (512, 512) and [i["role"] for i in first.inputs] == ["image", "mask"]
    per_compile = graphs(before)
    assert engine.layout_status(layout).state == "ready"
    with torch.compiler.set_stance("fail_on_recompile"):
        other = engine.inpaint(GenerateRequest("a blue door", "512x512", steps=4, seed=2, image=png(noise(90, 60)),
                                               mask=png(Image.new("L", (90, 60), 255)), strength=0.5))
    assert other.cache_event == "memory_hit" and other.strength == 0.5
    assert per_compile > 0


def test_inpaint_at_a_size_shares_the_graph_of_an_equal_total(engine):
    """inpaint 256x256 is 512 tokens, the graph of 256x256 + 1 reference 256x256, compiled above."""
    status = engine.layout_status(engine.layout("256x256", inpaint=True))
    assert status.state == "ready" and status.shares_graph_with == "256x256 + 1 ref 256x256"
    mask = Image.new("L", (256, 256), 0)
    mask.paste(255, (0, 0, 128, 128))
    with torch.compiler.set_stance("fail_on_recompile"):
        result = gen(engine, image=png(noise(256, 256)), mask=png(mask), strength=1.0)
    assert result.cache_event == "memory_hit" and result.tokens == 512


def test_bad_editing_requests_are_one_line_errors(engine):
    image, mask = png(noise(64, 64)), png(Image.new("L", (64, 64), 255))
    for kw, match in (
        ({"mask": mask}, "needs both an image and a mask"),
        ({"image": image, "mask": mask, "strength": 0}, "strength must be"),
        ({"image": image, "mask": mask, "strength": 1.5}, "strength must be"),
        ({"references": [image] * 3}, "at most 2"),
        ({"references": [image], "reference_size": "1024x1024"}, "reference size 1024x1024 is not one of"),
        ({"references": [image], "fit": "stretch"}, "fit must be one of"),
        ({"references": [b"GIF89a garbage"]}, "reference 1 is"),
        ({"image": image, "mask": png(Image.new("L", (32, 64), 255))}, "mask is 32x64 but the image is 64x64"),
    ):
        with pytest.raises(ValueError, match=match) as caught:
            gen(engine, **kw)
        assert "\n" not in str(caught.value)


def test_png_metadata_records_each_input(engine, tmp_path):
    data = png(noise(300, 200))
    result = gen(engine, references=[data], reference_size="256x256")
    path = result.save_png(tmp_path / "out.png")
    import hashlib
    import json

    params = json.loads(Image.open(path).text["parameters"])
    assert params["inputs"][0]["sha256"] == hashlib.sha256(data).hexdigest()
    assert params["inputs"][0]["fitted_size"] == "256x256" and params["tokens"] == 512


def test_from_pipe_shares_modules_and_keeps_the_dtype():
    pipe = build_tiny_pipeline(torch.bfloat16)
    inpaint = build_inpaint_pipeline(pipe)
    assert inpaint.transformer is pipe.transformer and inpaint.vae is pipe.vae
    assert pipe.transformer.dtype == torch.bfloat16 and inpaint.config.is_distilled


def test_layout_names_and_tokens():
    out, ref = parse_resolution("512x512"), parse_resolution("1024x1024")
    assert str(Layout(out)) == "512x512" and Layout(out).tokens == 1024
    assert str(Layout(out, (ref, ref), inpaint=True)) == "inpaint 512x512 + 2 refs 1024x1024"
    assert Layout(out, (ref, ref), inpaint=True).tokens == 2 * 1024 + 2 * 4096


def test_max_references_flag_and_environment():
    from neuron_ui.config.settings import build_parser, settings_from_args

    parser = build_parser()
    assert settings_from_args(parser.parse_args([]), environ={}).max_references == 2
    assert settings_from_args(parser.parse_args([]), environ={"NEURON_UI_MAX_REFERENCES": "4"}).max_references == 4
    flag = parser.parse_args(["--max-references", "1"])
    assert settings_from_args(flag, environ={"NEURON_UI_MAX_REFERENCES": "4"}).max_references == 1
    with pytest.raises(ValueError, match="--max-references must be 0 to 5"):
        settings_from_args(parser.parse_args(["--max-references", "9"]), environ={})
