"""Styles a stranger crafted (issue 34, items 3, 4 and 8): a LoRA whose metadata has the wrong shape, or whose
numbers are not finite, is left out at load in one line and the app starts with the rest; an image that comes out
as NaN is never delivered; a Hub repo id fails at once when the Hub does not answer.

Every file is written here, in tmp_path, with the tiny model's layer shapes and the header diffusers writes.
"""

import logging
import math
import socket

import huggingface_hub
import huggingface_hub.constants
import pytest
from runners import local_engine
import safetensors
import torch
from safetensors.torch import save_file

from neuron_ui import cli
from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.config.settings import Settings
from neuron_ui.contract.errors import EngineError
from neuron_ui.contract.engine_like import LoadingState
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.engine.styles import StyleBook
from neuron_ui.model.loading import LoadedModel
from neuron_ui.model.lora_files import METADATA_KEY, StyleError, download, load_style
from neuron_ui.model.lora_random import build_random_lora
from neuron_ui.model.tiny import build_tiny_pipeline
from neuron_ui.serving import choose_serving

SIZE = "256x256"


@pytest.fixture(scope="module")
def transformer():
    return build_tiny_pipeline().transformer


@pytest.fixture(scope="module")
def state(transformer):
    """A good rank-2 LoRA's factors in diffusers' keys, for the tiny transformer."""
    return {f"transformer.{k}": v for k, v in build_random_lora(transformer, rank=2, seed=3).items()}


def write(path, tensors, metadata: str | None):
    """A LoRA file with `metadata` as diffusers' header text, verbatim (NaN, Infinity and 1e308 are JSON here)."""
    save_file(tensors, path, metadata=None if metadata is None else {METADATA_KEY: metadata})
    return path


def empty_rank(state):
    return {k: v[:0] if k.endswith("lora_A.weight") else v[:, :0] for k, v in state.items()}


def poisoned(state, value):
    first = next(iter(state))
    return {**state, first: torch.full_like(state[first], value)}


# name -> (factors from the good state, header text, words the refusal must hold)
MALFORMED = {
    "list": (None, "[1, 2]", "metadata (lora_adapter_metadata) is a list"),
    "string": (None, '"hello"', "is a string ('hello'), not a JSON object"),
    "alpha string": (None, '{"transformer.r": 2, "transformer.lora_alpha": "8"}', "lora_alpha is a string ('8')"),
    "pattern list": (None, '{"transformer.lora_alpha": 2, "transformer.alpha_pattern": ["a"]}',
                     "alpha_pattern is a list"),
    "pattern regex": (None, '{"transformer.alpha_pattern": {"(a+)+$": 2}}', "is not a layer name"),
    "rslora string": (None, '{"transformer.lora_alpha": 2, "transformer.use_rslora": "yes"}',
                      "use_rslora is a string"),
    "rank 0": (empty_rank, '{"transformer.r": 0, "transformer.lora_alpha": 2}', "has rank 0"),
    "rank 0 rslora": (empty_rank, '{"transformer.r": 0, "transformer.lora_alpha": 2, "transformer.use_rslora": true}',
                      "has rank 0"),
    "deep": (None, "[" * 100_000 + "]" * 100_000, "is not JSON"),
}
NOT_FINITE = {
    "factor nan": (lambda s: poisoned(s, math.nan), None, "holds NaN or infinity"),
    "factor inf": (lambda s: poisoned(s, math.inf), None, "holds NaN or infinity"),
    "factor huge": (lambda s: poisoned(s, 1e38), None, "past what torch.float32 holds"),
    "alpha nan": (None, '{"transformer.lora_alpha": NaN}', "its alpha is not finite"),
    "alpha inf": (None, '{"transformer.lora_alpha": Infinity}', "its alpha is not finite"),
    "alpha 1e308": (None, '{"transformer.lora_alpha": 1e308}', "past what torch.float32 holds"),
    "alpha huge int": (None, '{"transformer.lora_alpha": 1' + "0" * 400 + "}", "its alpha is not finite"),
    "pattern nan": (None, '{"transformer.alpha_pattern": {"to_q": NaN}}', "its alpha is not finite"),
}
CASES = {**MALFORMED, **NOT_FINITE}


def write_case(folder, state, name):
    factors, metadata, _words = CASES[name]
    return write(folder / f"{name.replace(' ', '-')}.safetensors", factors(state) if factors else state, metadata)


@pytest.mark.parametrize("name", list(CASES))
def test_each_crafted_file_is_refused_in_one_line_naming_it(transformer, state, tmp_path, name):
    path = write_case(tmp_path, state, name)
    with pytest.raises(StyleError) as refused:
        load_style(str(path), transformer)
    line = str(refused.value)
    assert line.startswith(f"{path}: ") and CASES[name][2] in line and "\n" not in line and len(line) < 400, line


def test_the_same_factors_with_a_sane_header_load(transformer, state, tmp_path):
    """The refusals above are the header's or the numbers' fault: the same file with diffusers' header loads."""
    style = load_style(str(write(tmp_path / "fine.safetensors", state, '{"transformer.lora_alpha": 4}')), transformer)
    assert {layer.scaling for layer in style.layers} == {2.0}


def test_a_failure_no_check_foresaw_is_still_one_line(transformer, state, tmp_path, monkeypatch, caplog):
    path = write(tmp_path / "odd.safetensors", state, None)

    def broken_open(*args, **kwargs):
        raise RuntimeError("a reader fault\nwith a second line")

    monkeypatch.setattr(safetensors, "safe_open", broken_open)  # the library's reader, failing as none foresaw
    with caplog.at_level(logging.WARNING, logger="neuron_ui.engine.styles"):
        book = StyleBook.load([str(path)], transformer)
    assert book.styles == {}
    assert [r.getMessage() for r in caplog.records] == [f"style not loaded: {path}: RuntimeError: a reader fault"]


def test_the_app_starts_with_the_good_style_and_one_line_per_bad_one(state, tmp_path, caplog, environ):
    good = write(tmp_path / "good.safetensors", state, '{"transformer.lora_alpha": 2}')
    bad = [write_case(tmp_path, state, name) for name in ("list", "alpha string", "rank 0 rslora", "alpha nan")]
    settings = Settings(model="tiny", compile="eager", resolutions=parse_resolutions(SIZE), cache_dir=tmp_path / "c",
                        loras=(str(good), *map(str, bad)))
    with caplog.at_level(logging.WARNING, logger="neuron_ui.engine.styles"):
        engine = choose_serving(settings).load(LoadingState()).engine  # the server's start-up: the engine it serves
    assert list(engine.runner.styles.styles) == ["good"]
    lines = [r.getMessage() for r in caplog.records if r.name == "neuron_ui.engine.styles"]
    assert len(lines) == len(bad) and all(str(path) in line for path, line in zip(bad, lines)), lines


def test_headless_generate_with_a_crafted_style_exits_2_in_one_line(state, tmp_path, capsys, environ):
    bad = write_case(tmp_path, state, "pattern list")
    code = cli.main(["generate", "--model", "tiny", "--compile", "eager", "--resolutions", SIZE, "--cache-dir",
                     str(tmp_path / "cache"), "--prompt", "a lighthouse", "--resolution", SIZE, "--steps", "1",
                     "--lora", str(bad), "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "x.png").exists()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: style not loaded: {bad}: alpha_pattern is a list (['a']), not an object of layer "
                      "names to numbers"]
    assert "Traceback" not in err


# -- an image that is not numbers is never delivered ----------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    torch._dynamo.reset()
    cache = configure_cache_env(tmp_path_factory.mktemp("cache"), environ={})
    loaded = LoadedModel(build_tiny_pipeline(), name="tiny", is_tiny=True)
    return local_engine(loaded, presets=parse_resolutions(SIZE), compile_mode="eager", backend="eager", cache=cache,
                        manifest=CacheManifest(cache.manifest, error=cache.problem))


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_pipeline_making_nan_fails_in_one_line_not_a_black_image(engine, value):
    """The transformer's output projection set to NaN or infinity: the latents, then the pixels, are not finite."""
    weight = engine.runner.pipe.transformer.proj_out.weight
    original = weight.detach().clone()
    request = GenerateRequest("a lighthouse", SIZE, 1, 7)
    assert engine.generate(request).image.getextrema() != ((0, 0), (0, 0), (0, 0))  # finite weights: an image
    with torch.no_grad():
        weight.fill_(value)
    try:
        with pytest.raises(EngineError) as failed:
            engine.generate(request)
    finally:
        with torch.no_grad():
            weight.copy_(original)
    assert str(failed.value).startswith("no image: its pixels came out as NaN or infinity")
    assert "\n" not in str(failed.value)


# -- a Hub repo id when the Hub does not answer ---------------------------------------------------------------


@pytest.fixture
def online(monkeypatch):
    """The suite runs with HF_HUB_OFFLINE=1 (conftest.py); these tests ask a local server instead of the Hub."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_a_hub_that_never_answers_is_asked_once_within_the_bound(online):
    """huggingface_hub alone retries with back-off (about 23 s, 10 warnings); here one request, then one line."""
    with socket.socket() as silent:  # accepts connections (the kernel does) and never answers them
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(StyleError) as refused:
            download("nobody/never-a-style", 0.2, endpoint)
        silent.settimeout(0.0)
        requests = []
        while True:
            try:
                connection, _ = silent.accept()
            except BlockingIOError:
                break
            with connection:
                requests.append(connection.recv(200).split(b"\r\n")[0])
    assert str(refused.value) == ("nobody/never-a-style: the Hub did not answer within 0.2 s, and it is not in the "
                                  "local Hugging Face cache")
    assert requests == [b"HEAD /nobody/never-a-style/resolve/main/pytorch_lora_weights.safetensors HTTP/1.1"]


def test_the_requests_own_timeout_is_told_in_the_bounds_words(online, monkeypatch):
    """httpx's read timeout is the same bound as the thread's join; whichever fires first, the line is one (a
    fresh-clone run said "cannot be reached (ReadTimeout: timed out)" when httpx's came first)."""
    import httpx

    def times_out(*args, **kwargs):
        raise httpx.ReadTimeout("timed out")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", times_out)
    with pytest.raises(StyleError, match=r"^nobody/slow: the Hub did not answer within 0.2 s, and it is not in"):
        download("nobody/slow", 0.2, "http://127.0.0.1:9")


def test_a_hub_that_refuses_connections_is_one_line_at_once(online):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, not listening: refused
        with pytest.raises(StyleError, match=r"^owner/repo:w\.safetensors: the Hub cannot be reached \(ConnectError: "
                                             r".*\), and it is not in the local Hugging Face cache$"):
            download("owner/repo:w.safetensors", 5.0, endpoint)


def test_a_finite_image_is_the_one_diffusers_pil_output_gives(engine):
    """The pixels are checked as numbers and then converted as diffusers converts them: the same image."""
    from neuron_ui.model.runner import PipelineCall, run_pipeline

    plain = engine.runner.pipe(prompt="a red kite", height=256, width=256, num_inference_steps=1, guidance_scale=1.0,
                        generator=torch.Generator("cpu").manual_seed(3)).images[0]
    ours = run_pipeline(engine.runner.pipe, PipelineCall("a red kite", 256, 256, 1, 3, 1.0))
    assert ours.mode == plain.mode and ours.tobytes() == plain.tobytes()
