"""Real inductor compilation, the headless CLI, and the persistent cache across processes."""

import json
import shutil

import pytest
from cold_cache import PROMPT, RESOLUTION, SEED, first_image
from PIL import Image

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_processes(compiled_here, tmp_path_factory):
    """The same request in two processes sharing one cache folder: cold (the suite's `compiled_here`, a fresh
    `python -m neuron_ui generate`), then after a 'restart' on a copy of its folder (the shared one stays as the cold
    process left it; a copied folder hits as the folder itself does)."""
    here, cold = compiled_here
    root = tmp_path_factory.mktemp("inductor")
    shutil.copytree(here, root / "cache")
    return root, cold, first_image(root / "cache", root / "warm.png")


def test_cold_process_compiles_and_restart_hits_the_disk_cache(compiled_here, two_processes):
    here, _ = compiled_here
    root, cold, warm = two_processes
    assert cold["cache_event"] == "compiled"
    assert warm["cache_event"] == "disk_hit"
    assert warm["compile_seconds"] < cold["compile_seconds"] / 2, (warm, cold)
    assert (here / "inductor").is_dir() and any((here / "inductor").iterdir())
    manifest = json.loads((root / "cache" / "manifest.json").read_text())
    (entry,) = manifest["entries"].values()
    assert entry["key"]["backend"] == "inductor" and entry["key"]["model"] == "tiny"
    assert entry["shapes"][RESOLUTION]["event"] == "disk_hit"
    assert entry["shapes"][RESOLUTION]["cold_seconds"] == pytest.approx(cold["compile_seconds"], abs=0.01)


def test_cli_png_carries_its_parameters_and_images_match_across_processes(two_processes):
    root, cold, warm = two_processes
    image = Image.open(cold["out"])
    assert image.size == (256, 256)
    assert image.text["prompt"] == PROMPT and image.text["seed"] == str(SEED)
    assert json.loads(image.text["parameters"])["cache_event"] == "compiled"
    assert list(Image.open(root / "warm.png").getdata()) == list(image.getdata())
    assert warm["image"] == cold["image"]


def test_in_process_inductor_engine_then_memory_hit(two_processes, make_engine, monkeypatch):
    root, _, _ = two_processes
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "cache" / "inductor"))
    engine = make_engine(presets=RESOLUTION, backend="inductor", cache_dir=root / "cache")
    from neuron_ui.contract.requests import GenerateRequest

    first = engine.generate(GenerateRequest("x", RESOLUTION, seed=2))
    assert first.cache_event == "disk_hit"
    assert engine.generate(GenerateRequest("y", RESOLUTION, seed=3)).cache_event == "memory_hit"


def test_cli_rejects_bad_input_with_a_clear_message(tmp_path, capsys):
    """In this process (`python -m neuron_ui` exits with what main returns): a new Python cost 4 s for one line."""
    from neuron_ui.cli import main

    code = main(["generate", "--model", "tiny", "--cache-dir", str(tmp_path), "--prompt", "x", "--resolution",
                 "1000x1000", "--compile", "eager"])
    err = capsys.readouterr().err
    assert code == 2
    assert "error: resolution 1000x1000: width 1000 is not a multiple of 16" in err
    assert "Traceback" not in err
