"""Step previews on the tiny model: the token order and shapes against the pipeline's own unpacking, the flow-matching
arithmetic, the projection, and the engine's previews (which step, what size, only when asked and allowed). The
colours mean nothing on random weights; the real model's are for a person to look at."""

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline
from runners import local_engine

from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.compile.counters import read_counters
from neuron_ui.contract.results import CacheEvent
from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.results import StepPreview
from neuron_ui.engine.engine import Engine
from neuron_ui.model.loading import LoadedModel
from neuron_ui.model.preview import (
    LATENT_RGB_BIAS,
    LATENT_RGB_FACTORS,
    build_preview,
    estimate_x0,
    project_rgb,
    unpack_tokens,
)
from neuron_ui.model.tiny import build_tiny_pipeline

SIZE = "384x256"  # not square: a transposed grid would show


def pipeline_unpacking(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The pipeline's own: its latent ids for the grid, the scatter by ids, the unpatchify (diffusers 0.42.1)."""
    ids = Flux2KleinPipeline._prepare_latent_ids(torch.zeros(tokens.shape[0], tokens.shape[2], height, width))
    grid = Flux2KleinPipeline._unpack_latents_with_ids(tokens, ids, height, width)
    return Flux2KleinPipeline._unpatchify_latents(grid)


@pytest.mark.parametrize("channels", [128, 16])  # klein's, the tiny model's
def test_token_order_and_shapes_match_the_pipelines_unpacking(channels):
    torch.manual_seed(0)
    grid = torch.randn(2, channels, 3, 5)
    tokens = Flux2KleinPipeline._pack_latents(grid)
    mine = unpack_tokens(tokens, 3, 5)
    assert mine.shape == (2, channels // 4, 6, 10)
    assert torch.equal(mine, pipeline_unpacking(tokens, 3, 5))
    with pytest.raises(ValueError, match="not a 5x4 grid"):
        unpack_tokens(tokens, 4, 5)


def test_a_1024_image_previews_at_128x128():
    tokens = torch.randn(1024 // 16 * 1024 // 16, 128)
    preview = build_preview(tokens, torch.zeros_like(tokens), 0.0, 0.5, 1024, 1024, 4, 4)
    assert (preview.width, preview.height, len(preview.rgb)) == (128, 128, 128 * 128 * 3)
    assert preview.image().size == (128, 128)


def test_x0_is_the_latents_less_sigma_times_the_velocity():
    torch.manual_seed(1)
    x0, noise = torch.randn(4, 8), torch.randn(4, 8)
    velocity = noise - x0  # flow matching: x_t = x0 + t (noise - x0)
    before, now = x0 + 0.75 * velocity, x0 + 0.5 * velocity
    assert torch.allclose(estimate_x0(now, before, 0.5, 0.75), x0, atol=1e-6)
    assert torch.equal(estimate_x0(x0, before, 0.0, 0.75), x0)  # the last step: sigma 0, the latents themselves


def test_the_projection_is_comfyuis_factors_and_bias():
    latents = torch.zeros(32, 2, 3)
    latents[3, 0, 1] = 1.0  # channel 3 alone at row 0, column 1
    latents[8, 1, 2] = -2.0
    pixels = project_rgb(latents).numpy()
    assert pixels.shape == (2, 3, 3) and pixels.dtype == np.uint8

    def expected(rgb):
        return np.round(np.clip((np.array(rgb) + 1) / 2, 0, 1) * 255)

    bias = np.array(LATENT_RGB_BIAS)
    assert np.array_equal(pixels[0, 1], expected(np.array(LATENT_RGB_FACTORS[3]) + bias))
    assert np.array_equal(pixels[1, 2], expected(-2 * np.array(LATENT_RGB_FACTORS[8]) + bias))
    assert np.array_equal(pixels[0, 0], expected(bias))
    with pytest.raises(ValueError, match="33 channels"):
        project_rgb(torch.zeros(33, 1, 1))


def test_a_preview_crosses_a_process_as_a_small_png():
    preview = StepPreview(2, 4, 48, 32, bytes(range(256)) * 18)
    back = StepPreview.from_png(2, 4, preview.png())
    assert back == preview and len(preview.png()) < 48 * 32 * 3
    with pytest.raises(ValueError, match="larger than any preview"):
        StepPreview.from_png(1, 1, StepPreview(1, 1, 1025, 1, bytes(1025 * 3)).png())


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return configure_cache_env(tmp_path_factory.mktemp("cache"), environ={})


def build_engine(cache, previews: bool = True, compile_mode: str = "eager") -> Engine:
    return local_engine(LoadedModel(build_tiny_pipeline(), name="tiny", is_tiny=True), presets=parse_resolutions(SIZE),
                        compile_mode=compile_mode, backend="eager", cache=cache,
                        manifest=CacheManifest(cache.manifest, error=cache.problem), previews=previews)


@pytest.fixture(scope="module")
def engine(cache):
    return build_engine(cache)


def generate(engine: Engine, preview: bool, steps: int = 3, seed: int = 5):
    updates = []
    result = engine.generate(GenerateRequest("a lighthouse", SIZE, steps, seed, preview=preview),
                             progress=updates.append)
    return result, [u.preview for u in updates if u.preview is not None]


def test_the_engine_previews_each_step_after_the_first_only_when_asked(engine):
    plain, none = generate(engine, preview=False)
    result, previews = generate(engine, preview=True)
    assert none == []
    assert [(p.step, p.steps) for p in previews] == [(2, 3), (3, 3)]
    assert {(p.width, p.height) for p in previews} == {(384 // 8, 256 // 8)}
    assert np.array_equal(np.asarray(result.image), np.asarray(plain.image))  # previews change nothing


def test_the_last_preview_is_the_projection_of_the_finished_latents(engine):
    """The last step's sigma is 0: its estimate is the latents the VAE decodes, read here through the pipeline's own
    decode path (output_type="latent": unpacked, BN undone, unpatchified) and projected."""
    _, previews = generate(engine, preview=True, steps=2, seed=9)
    pipe = engine.runner.pipe
    embeds = engine.runner.pipeline.prompt_embeds("a lighthouse")
    latents = pipe(prompt_embeds=embeds, width=384, height=256, num_inference_steps=2,
                   generator=torch.Generator("cpu").manual_seed(9), output_type="latent").images
    patches = Flux2KleinPipeline._patchify_latents(latents)
    mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    normalised = Flux2KleinPipeline._unpatchify_latents((patches - mean) / std)
    expected = project_rgb(normalised[0]).numpy()
    got = np.asarray(previews[-1].image())
    assert got.shape == expected.shape == (32, 48, 3)
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1  # float rounding of the BN round trip


def test_a_server_without_previews_sends_none(cache):
    _, previews = generate(build_engine(cache, previews=False), preview=True, steps=2)
    assert previews == []


def test_previews_never_recompile(cache):
    """Compiled once without previews, then previews at other steps and seeds: no graph is traced again. One mode
    (regional, the default) for the suite's time: previews run no device code but a copy, in any mode."""
    torch._dynamo.reset()
    compiled = build_engine(cache, compile_mode="regional")
    try:
        generate(compiled, preview=False, steps=2)
        before = read_counters()
        with torch._dynamo.config.patch(error_on_recompile=True), torch.compiler.set_stance("fail_on_recompile"):
            for steps, seed in ((2, 1), (3, 2)):
                result, previews = generate(compiled, preview=True, steps=steps, seed=seed)
                assert result.cache_event == CacheEvent.MEMORY_HIT and len(previews) == steps - 1
        assert read_counters().graphs == before.graphs
    finally:
        torch._dynamo.reset()


def test_no_previews_turns_them_off_for_the_whole_server():
    from neuron_ui.config.settings import build_parser, settings_from_args

    def parsed(*flags, environ=None):
        return settings_from_args(build_parser().parse_args(list(flags)), environ=environ or {})

    assert parsed().previews
    assert not parsed("--no-previews").previews
    assert not parsed(environ={"NEURON_UI_NO_PREVIEWS": "1"}).previews


def test_preview_files_keep_the_newest_and_a_full_disk_loses_only_the_preview(tmp_path):
    from neuron_ui.web.files import PreviewFiles

    files = PreviewFiles(tmp_path / "previews", keep=3)
    files.folder.mkdir()
    paths = [files.save(StepPreview(step, 9, 2, 2, bytes(12))) for step in range(1, 6)]
    assert sorted(p.name for p in files.folder.iterdir()) == sorted(p.rsplit("/", 1)[-1] for p in paths[-3:])
    gone = PreviewFiles(tmp_path / "missing", keep=3)  # writing there fails, as on a full disk
    assert gone.save(StepPreview(1, 1, 2, 2, bytes(12))) is None
