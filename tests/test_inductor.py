"""Real inductor compilation, the headless CLI, and the persistent cache across processes.

The cold process is the suite's one (conftest's `compiled_here`: a fresh `python -m neuron_ui generate` on an empty
folder); the restart is an engine in this process on a copy of its folder (a copied folder hits as the folder itself
does), so no second new Python pays its imports here. A new process warm from that folder's files is
tests/test_bundle_fetch.py's slow test (fetched as a bundle, its first image a disk hit, pixel for pixel the cold one).
"""

import json
import shutil

import pytest
from cold_cache import PROMPT, RESOLUTION, SEED, image_digest
from PIL import Image

from neuron_ui.contract.requests import GenerateRequest

pytestmark = pytest.mark.slow


def test_cold_process_compiles_and_restart_hits_the_disk_cache_then_memory(compiled_here, make_engine, tmp_path,
                                                                          monkeypatch):
    here, cold = compiled_here
    assert cold["cache_event"] == "compiled"
    assert (here / "inductor").is_dir() and any((here / "inductor").iterdir())
    shutil.copytree(here, tmp_path / "cache")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache" / "inductor"))
    engine = make_engine(presets=RESOLUTION, backend="inductor", cache_dir=tmp_path / "cache")

    warm = engine.generate(GenerateRequest(PROMPT, RESOLUTION, seed=SEED))
    assert warm.cache_event == "disk_hit"
    assert warm.compile_seconds < cold["compile_seconds"] / 2, (warm.compile_seconds, cold)
    assert image_digest(warm.image) == cold["image"]  # the cold process's image, pixel for pixel
    assert engine.generate(GenerateRequest("y", RESOLUTION, seed=3)).cache_event == "memory_hit"

    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    (entry,) = manifest["entries"].values()
    assert entry["key"]["backend"] == "inductor" and entry["key"]["model"] == "tiny"
    assert entry["shapes"][RESOLUTION]["event"] == "disk_hit"
    assert entry["shapes"][RESOLUTION]["cold_seconds"] == pytest.approx(cold["compile_seconds"], abs=0.01)


def test_cli_png_carries_its_parameters(compiled_here):
    _, cold = compiled_here
    image = Image.open(cold["out"])
    assert image.size == (256, 256)
    assert image.text["prompt"] == PROMPT and image.text["seed"] == str(SEED)
    assert json.loads(image.text["parameters"])["cache_event"] == "compiled"


def test_cli_rejects_bad_input_with_a_clear_message(tmp_path, capsys):
    """In this process (`python -m neuron_ui` exits with what main returns): a new Python cost 4 s for one line."""
    from neuron_ui.cli import main

    code = main(["generate", "--model", "tiny", "--cache-dir", str(tmp_path), "--prompt", "x", "--resolution",
                 "1000x1000", "--compile", "eager"])
    err = capsys.readouterr().err
    assert code == 2
    assert "error: resolution 1000x1000: width 1000 is not a multiple of 16" in err
    assert "Traceback" not in err
