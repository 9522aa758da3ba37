"""Styles (LoRA adapters, --lora) on the tiny model: switched between images, never compiled, correct images.

One engine (regional torch.compile, the cheap eager backend) runs the switch sequence once for the module; the
other tests read its results. The reference for correctness is the plain diffusers pipeline with the same file
loaded the documented way (load_lora_weights + set_adapters).
"""

import json
import logging
import pickle
import shutil
import threading

import numpy as np
import pytest
import torch
from PIL import Image
from runners import local_engine
from safetensors.torch import save_file

from neuron_ui import cli
from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.contract.results import CacheEvent
from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.config.settings import Settings, build_parser, settings_from_args
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.engine.engine import Engine
from neuron_ui.engine.styles import StyleBook
from neuron_ui.model.loading import LoadedModel
from neuron_ui.model.lora_files import file_sha256
from neuron_ui.model.lora_random import build_random_lora, write_random_lora
from neuron_ui.model.tiny import build_tiny_pipeline

PROMPT = "a lighthouse at dusk"
SIZE = "256x256"
TOLERANCE = 2  # pixels (0-255): fused weights round differently from diffusers' unfused LoRA layers


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def max_diff(a: Image.Image, b: Image.Image) -> int:
    return int(np.abs(pixels(a) - pixels(b)).max())


def mean_diff(a: Image.Image, b: Image.Image) -> float:
    return float(np.abs(pixels(a) - pixels(b)).mean())


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return configure_cache_env(tmp_path_factory.mktemp("cache"), environ={})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Style A (rank 4, alpha = rank) and B (rank 2, alpha 4: a scaling of 2), for the tiny model's transformer."""
    folder = tmp_path_factory.mktemp("styles")
    transformer = build_tiny_pipeline().transformer
    return {"a": write_random_lora(transformer, folder / "ink.safetensors", rank=4, seed=1),
            "b": write_random_lora(transformer, folder / "neon.safetensors", rank=2, seed=2, alpha=4),
            "folder": folder}


def build_engine(files, cache, compile_mode: str = "regional", backend: str = "eager") -> Engine:
    torch._dynamo.reset()
    loaded = LoadedModel(build_tiny_pipeline(), name="tiny", is_tiny=True)
    styles = StyleBook.load([str(files["a"]), f"bee={files['b']}@0.5"], loaded.pipe.transformer)
    return local_engine(loaded,
                        presets=parse_resolutions(SIZE), compile_mode=compile_mode, backend=backend, cache=cache,
                        manifest=CacheManifest(cache.manifest, error=cache.problem), styles=styles)


@pytest.fixture(scope="module")
def engine(files, cache):
    yield build_engine(files, cache)
    torch._dynamo.reset()


def request(lora=None, scale=None, seed=5, steps=2) -> GenerateRequest:
    return GenerateRequest(PROMPT, SIZE, steps, seed, lora=lora, lora_scale=scale)


SWITCHES = [("base", None, None), ("ink", "ink", 0.8), ("bee", "bee", None), ("bee strength", "bee", 1.5),
            ("none", None, None)]


def run_switches(engine: Engine, steps: int = 2, switches=SWITCHES) -> dict:
    """The base image first (it compiles the size), then every switch with recompiles made errors."""
    results = {"base": engine.generate(request(steps=steps))}
    weights = {k: v.clone() for k, v in engine.runner.pipe.transformer.state_dict().items()}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for label, lora, scale in switches[1:]:
            results[label] = engine.generate(request(lora, scale, steps=steps))
    results["weights"] = weights
    results["weights after"] = {k: v.clone() for k, v in engine.runner.pipe.transformer.state_dict().items()}
    return results


@pytest.fixture(scope="module")
def sequence(engine):
    return run_switches(engine)


def test_every_switch_is_a_memory_hit_and_compiles_nothing(sequence, files):
    assert sequence["base"].cache_event == "compiled"
    for label, lora, _scale in SWITCHES[1:]:
        result = sequence[label]
        assert result.cache_event == CacheEvent.MEMORY_HIT, label
        assert result.lora == lora
    assert [sequence[k].lora_scale for k in ("ink", "bee", "bee strength", "none")] == [0.8, 0.5, 1.5, None]
    assert sequence["bee"].lora_sha256 == file_sha256(files["b"])


@pytest.fixture(scope="module")
def diffusers_images(files):
    """The plain diffusers pipeline, with each style loaded the documented way at the same weight."""
    images = {}
    for label, path, weight in (("ink", files["a"], 0.8), ("bee", files["b"], 0.5)):
        pipe = build_tiny_pipeline()
        pipe.set_progress_bar_config(disable=True)
        pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=label)
        pipe.set_adapters([label], adapter_weights=[weight])
        images[label] = pipe(prompt=PROMPT, height=256, width=256, num_inference_steps=2,
                             generator=torch.Generator("cpu").manual_seed(5)).images[0]
    return images


@pytest.mark.parametrize("label", ["ink", "bee"])
def test_a_style_matches_diffusers_load_lora_weights(sequence, diffusers_images, label):
    ours = sequence[label].image
    assert max_diff(ours, diffusers_images[label]) <= TOLERANCE
    assert mean_diff(ours, sequence["base"].image) > 3  # the style visibly changed the image: the match means something


def test_back_to_none_gives_the_base_image_and_the_base_weights_bit_for_bit(sequence):
    assert max_diff(sequence["none"].image, sequence["base"].image) <= TOLERANCE
    assert mean_diff(sequence["bee"].image, sequence["bee strength"].image) > 1  # the strength change changed it
    after = sequence["weights after"]
    assert all(torch.equal(after[k], v) for k, v in sequence["weights"].items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_read_from_a_folder_restores_from_its_file_not_from_copies(files, tmp_path, dtype):
    """A transformer diffusers read from a folder keeps no host copies of the weights a style targets (klein-4B's,
    with a LoRA on every linear layer, were 7.3 GB: the transformer twice, issue 45): its safetensors file holds them,
    and a switch back reads them from there, bit for bit, also when the file is in another dtype. A layer whose
    weights differ from the file's is copied, as is every layer of a model built in code."""
    from diffusers import Flux2KleinPipeline

    build_tiny_pipeline().save_pretrained(tmp_path / "tiny")
    pipe = Flux2KleinPipeline.from_pretrained(tmp_path / "tiny", torch_dtype=dtype)
    transformer = pipe.transformer
    changed = "transformer_blocks.0.attn.to_q"
    with torch.no_grad():
        transformer.get_submodule(changed).weight.add_(1)  # no longer what the file holds
    base = {k: v.clone() for k, v in transformer.state_dict().items()}
    styles = StyleBook.load([str(files["a"]), f"bee={files['b']}"], transformer)
    fuser = styles.fuser
    assert fuser.host_bytes == transformer.get_submodule(changed).weight.nbytes  # that one layer only
    for style, strength in (("ink", 1.0), ("bee", 0.7), ("ink", 0.3)):
        assert fuser.use(styles.styles[style], strength) > 0
    fused_from_file = {k: v.clone() for k, v in transformer.state_dict().items()}
    fuser.use(None, 0.0)
    assert all(torch.equal(v, base[k]) for k, v in transformer.state_dict().items())
    copied = StyleBook.load([str(files["a"]), f"bee={files['b']}"], build_tiny_pipeline(dtype).transformer).fuser
    assert copied.host_bytes > 100 * fuser.host_bytes  # built in code: every targeted layer copied
    # The same switches from copies (a fuser given no file) give the same weights as from the file.
    from neuron_ui.model.styles import StyleFuser

    twin = Flux2KleinPipeline.from_pretrained(tmp_path / "tiny", torch_dtype=dtype).transformer
    with torch.no_grad():
        twin.get_submodule(changed).weight.add_(1)
    copies = StyleFuser(twin)
    for style in styles.styles.values():
        copies.keep_originals(style)
    for style, strength in (("ink", 1.0), ("bee", 0.7), ("ink", 0.3)):
        copies.use(styles.styles[style], strength)
    assert all(torch.equal(v, fused_from_file[k]) for k, v in twin.state_dict().items())


def test_a_to_b_fuses_exactly_the_weights_none_to_b_does(engine):
    fuser, styles = engine.runner.styles.fuser, engine.runner.styles.styles
    fuser.use(styles["ink"], 1.0)
    fuser.use(styles["bee"], 0.7)
    after_a = {k: v.clone() for k, v in engine.runner.pipe.transformer.state_dict().items()}
    fuser.use(None, 0.0)
    assert fuser.use(styles["bee"], 0.7) > 0
    assert all(torch.equal(v, after_a[k]) for k, v in engine.runner.pipe.transformer.state_dict().items())
    assert fuser.use(styles["bee"], 0.7) == 0.0  # already fused: nothing to do
    fuser.use(None, 0.0)


def test_two_users_with_different_styles_each_get_theirs(engine, sequence):
    asks = [("ink", 0.8), ("bee", None), ("ink", 0.8), ("bee", None)]
    results: list = [None] * len(asks)
    start = threading.Barrier(len(asks))

    def user(index: int) -> None:
        start.wait()
        results[index] = engine.generate(request(*asks[index]))

    threads = [threading.Thread(target=user, args=(i,)) for i in range(len(asks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (lora, _), result in zip(asks, results):
        assert result.lora == lora and result.cache_event == CacheEvent.MEMORY_HIT
        assert max_diff(result.image, sequence[lora].image) == 0


@pytest.mark.parametrize("mode", ["eager", "full"])
def test_no_compile_mode_compiles_for_a_style(files, cache, mode):
    engine = build_engine(files, cache, mode)
    switches = [s for s in SWITCHES if s[0] != "bee strength"]  # the regional engine above runs that one too
    try:
        results = run_switches(engine, steps=1, switches=switches)
    finally:
        torch._dynamo.reset()
    events = {results[label].cache_event for label, _, _ in switches[1:]}
    assert events == {CacheEvent.EAGER if mode == "eager" else CacheEvent.MEMORY_HIT}
    assert max_diff(results["none"].image, results["base"].image) <= TOLERANCE
    assert mean_diff(results["ink"].image, results["base"].image) > 3


@pytest.mark.slow
def test_aot_packages_take_styles_as_weights(files, aot_compiled_here, tmp_path):
    """AOTInductor packages take the weights as inputs: a switch reaches them without a new package. The packages are
    a copy of the suite's cold AOT compile (conftest's aot_compiled_here, made with no style loaded: the same key and
    block signatures, since a style is fused into the weights); a compiled package is loaded from its file just as
    one found on disk is (compile/aot.py's PackageStore), so the packages here are the ones a compile here would run."""
    shutil.copytree(aot_compiled_here[0] / "cache", tmp_path / "cache")
    made = sorted((tmp_path / "cache" / "aot").rglob("*.pt2"))
    engine = build_engine(files, configure_cache_env(tmp_path / "cache", environ={}), "aot", "inductor")
    try:
        results = run_switches(engine, steps=1)
    finally:
        torch._dynamo.reset()
    assert len(made) == 2 and results["base"].cache_event == CacheEvent.DISK_HIT  # the packages load, none compiles
    assert {results[label].cache_event for label, _, _ in SWITCHES[1:]} == {CacheEvent.MEMORY_HIT}
    assert sorted((tmp_path / "cache" / "aot").rglob("*.pt2")) == made  # no package of any other key or signature
    assert max_diff(results["none"].image, results["base"].image) <= TOLERANCE
    assert mean_diff(results["ink"].image, results["base"].image) > 3


# -- bad files: the app starts without them, one line each ----------------------------------------------------


def bad_files(folder, good) -> dict:
    """One file per way a style can be wrong, and the words its line must hold."""
    state = build_random_lora(build_tiny_pipeline().transformer, rank=2, seed=3)
    prefixed = {f"transformer.{k}": v for k, v in state.items()}
    cases = {}

    def write(name, tensors, reason):
        path = folder / name
        save_file(tensors, path)
        cases[name] = (path, reason)

    (folder / "notes.safetensors").write_bytes(b"this is not a safetensors file at all")
    cases["notes.safetensors"] = (folder / "notes.safetensors", "not a safetensors file")
    data = good.read_bytes()
    (folder / "cut.safetensors").write_bytes(data[: len(data) // 2])
    cases["cut.safetensors"] = (folder / "cut.safetensors", "truncated")
    key = next(iter(prefixed))
    write("flux1.safetensors", {"transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 32),
                                "transformer.single_transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(32, 2)},
          "not in this transformer")
    write("sdxl.safetensors", {"unet.down_blocks.0.attentions.0.proj_in.lora_A.weight": torch.ones(2, 8),
                               "unet.down_blocks.0.attentions.0.proj_in.lora_B.weight": torch.ones(8, 2)},
          "not for a transformer")
    write("wide.safetensors", {**prefixed, key: torch.ones(2, 64)}, "wrong shapes")
    write("te.safetensors", {"text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 16),
                             "text_encoder.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(16, 2)},
          "text encoder")
    write("lokr.safetensors", {"transformer.transformer_blocks.0.attn.to_q.lokr_w1": torch.ones(4, 4),
                               "transformer.transformer_blocks.0.attn.to_q.lokr_w2": torch.ones(8, 8)}, "LoKr")
    return cases


def test_bad_files_are_left_out_with_one_line_each(files, tmp_path, caplog):
    cases = bad_files(tmp_path, files["a"])
    transformer = build_tiny_pipeline().transformer
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    specs = [str(files["a"]), *(str(path) for path, _ in cases.values()), f"{files['b']}@7", "ink2=" + str(tmp_path),
             str(files["a"])]
    with caplog.at_level(logging.WARNING, logger="neuron_ui.engine.styles"):
        book = StyleBook.load(specs, transformer)
    assert list(book.styles) == ["ink"]
    lines = [r.getMessage() for r in caplog.records if r.name == "neuron_ui.engine.styles"]
    assert len(lines) == len(specs) - 1 and all("\n" not in line for line in lines)
    for (path, reason), line in zip(cases.values(), lines):
        assert str(path) in line and reason in line, line
    assert "must be from 0 to 2" in lines[-3]
    assert "the folder has" in lines[-2] and "name the file itself" in lines[-2]
    assert "already named 'ink'" in lines[-1]
    assert all(torch.equal(v, before[k]) for k, v in transformer.state_dict().items())  # loading touched nothing


def test_a_request_for_an_unknown_style_names_the_allowed_ones(engine, files):
    with pytest.raises(ValueError, match=r"^lora 'nope' is not a style loaded here; allowed: None, ink, bee$"):
        engine.generate(request("nope"))
    with pytest.raises(ValueError, match="lora_scale must be a number from 0 to 2"):
        engine.generate(request("ink", 2.5))
    with pytest.raises(ValueError, match="lora_scale must be a number from 0 to 2"):
        engine.generate(request("ink", float("nan")))
    with pytest.raises(ValueError, match=r"lora \['ink'\] is not a style"):
        engine.generate(request(["ink"]))
    assert engine.runner.prepare(request("None", 1.5), engine.layout(SIZE)).lora is None  # the dropdown's None


def test_result_and_png_carry_the_style(sequence, tmp_path):
    result = sequence["bee"]
    info = result.info()
    assert (info["lora"], info["lora_scale"]) == ("bee", 0.5) and len(info["lora_sha256"]) == 64
    saved = Image.open(result.save_png(tmp_path / "bee.png"))
    parameters = json.loads(saved.text["parameters"])
    assert (parameters["lora"], parameters["lora_scale"], parameters["lora_sha256"]) == ("bee", 0.5,
                                                                                          info["lora_sha256"])
    assert saved.text["lora"].startswith("bee at 0.5 (sha256 ")
    assert "lora" not in Image.open(sequence["base"].save_png(tmp_path / "base.png")).text


def test_status_lists_the_styles_and_the_one_in_the_weights(engine):
    engine.generate(request("ink", 0.8))
    styles = {s["name"]: s for s in engine.status().styles}
    assert styles["ink"]["fused"] == 0.8 and styles["bee"]["fused"] is None
    assert styles["bee"]["default_scale"] == 0.5 and styles["ink"]["rank"] == 4 and styles["ink"]["host_mb"] > 0


# -- settings, the command line, replicas ------------------------------------------------------------------------


def test_lora_flags_and_environment():
    parse = build_parser().parse_args
    assert settings_from_args(parse(["--lora", "a.safetensors", "--lora", "b=x/y@0.5"]), {}).loras == (
        "a.safetensors", "b=x/y@0.5")
    assert settings_from_args(parse([]), {"NEURON_UI_LORAS": "a.safetensors, b.safetensors"}).loras == (
        "a.safetensors", "b.safetensors")
    with pytest.raises(ValueError, match=r"^--lora with --tp: .*serve styles without --tp"):
        Settings(loras=("a.safetensors",), tp=2)


def test_replicas_get_every_style_through_their_settings(files):
    """Each replica builds its runner with LocalRunner.from_settings(settings): the styles travel in the settings (Ray
    pickles them) and in each request (the front pickles it whole)."""
    from neuron_ui.replicas.runner import portable

    settings = pickle.loads(pickle.dumps(Settings(model="tiny", loras=(str(files["a"]),))))
    assert settings.loras == (str(files["a"]),)
    assert portable(request("ink", 0.3)).lora_scale == 0.3


def test_a_random_lora_for_a_folder_reads_its_transformer_config_not_its_weights(tmp_path, capsys):
    """`lora random --model FOLDER` builds the transformer's layers from its config alone (klein-4B's weights are
    7.75 GB): with the weights gone it still writes the same LoRA as for the model the folder was saved from."""
    from safetensors.torch import load_file

    from neuron_ui.model.tiny import build_tiny_pipeline

    folder = tmp_path / "tiny"
    build_tiny_pipeline().save_pretrained(folder)
    for weights in (folder / "transformer").glob("*.safetensors"):
        weights.unlink()
    made = {}
    for model in ("tiny", str(folder)):
        made[model] = tmp_path / f"{len(made)}.safetensors"
        assert cli.main(["lora", "random", "--model", model, "--rank", "2", "--seed", "5", "--out",
                         str(made[model])]) == 0
    assert f"for {folder}'s transformer" in capsys.readouterr().out
    ours, theirs = (load_file(path) for path in made.values())
    assert ours.keys() == theirs.keys() and len(ours) > 0
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)


def test_random_lora_and_headless_generate_with_a_style(tmp_path, capsys, environ):
    out = tmp_path / "style.safetensors"
    assert cli.main(["lora", "random", "--model", "tiny", "--rank", "4", "--seed", "1", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    torch._dynamo.reset()
    common = ["generate", "--model", "tiny", "--compile", "eager", "--resolutions", SIZE, "--cache-dir",
              str(tmp_path / "cache"), "--prompt", PROMPT, "--resolution", SIZE, "--steps", "1", "--seed", "3"]
    assert cli.main([*common, "--lora", str(out), "--lora-scale", "0.7", "--out", str(tmp_path / "s.png")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["lora"], info["lora_scale"], info["lora_sha256"]) == ("style", 0.7, file_sha256(out))
    assert json.loads(Image.open(tmp_path / "s.png").text["parameters"])["lora"] == "style"
    (tmp_path / "bad.safetensors").write_bytes(b"nope")
    assert cli.main([*common, "--lora", str(tmp_path / "bad.safetensors")]) == 2
    assert "error: style not loaded: " in capsys.readouterr().err


# -- the UI's side: what the browser sends back is untrusted ----------------------------------------------------


def test_style_controls_restore_only_loaded_styles_and_sane_strengths():
    from types import SimpleNamespace

    import gradio as gr

    from neuron_ui.ui.history import HistoryEntry
    from neuron_ui.ui.styles import StyleHandlers, request_style

    engine = SimpleNamespace(status=lambda: SimpleNamespace(styles=[{"name": "ink", "default_scale": 0.8}]))
    handlers = StyleHandlers(engine)
    assert handlers.on_restore({"style": "ink", "strength": 1.5}) == ("ink", 1.5)
    assert handlers.on_restore({"style": "ink", "strength": "9; drop"}) == ("ink", 0.8)  # its default instead
    assert handlers.on_restore({"style": "../../etc/passwd"}) == (gr.skip(), gr.skip())
    history = [HistoryEntry("a.png", "", "p", "256x256", 1, lora=lora, lora_scale=scale)
               for lora, scale in (("ink", 0.3), ("gone", 1.0), (None, None))]
    picks = [handlers.on_select(history, SimpleNamespace(index=i)) for i in range(3)]
    assert picks == [("ink", 0.3), ("None", gr.skip()), ("None", gr.skip())]
    assert handlers.on_style("ink") == 0.8
    assert request_style("None", 1.2) == (None, None) and request_style("ink", 1.2) == ("ink", 1.2)
