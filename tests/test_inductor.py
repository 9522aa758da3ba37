"""Real inductor compilation, the headless CLI, and the persistent cache across processes."""

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

pytestmark = pytest.mark.slow


def run_cli(*args, cache_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "neuron_ui", "generate", "--model", "tiny", "--cache-dir", str(cache_dir), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, timeout=480)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The same request in two processes sharing one cache folder: cold, then after a 'restart'."""
    root = tmp_path_factory.mktemp("inductor")
    args = ["--prompt", "a lighthouse at dusk", "--resolution", "512x512", "--seed", "1"]
    cold = run_cli(*args, "--out", str(root / "cold.png"), cache_dir=root / "cache")
    warm = run_cli(*args, "--out", str(root / "warm.png"), cache_dir=root / "cache")
    return root, json.loads(cold.stdout), json.loads(warm.stdout)


def test_cold_process_compiles_and_restart_hits_the_disk_cache(two_processes):
    root, cold, warm = two_processes
    assert cold["cache_event"] == "compiled"
    assert warm["cache_event"] == "disk_hit"
    assert warm["compile_seconds"] < cold["compile_seconds"] / 2, (warm, cold)
    assert (root / "cache" / "inductor").is_dir() and any((root / "cache" / "inductor").iterdir())
    manifest = json.loads((root / "cache" / "manifest.json").read_text())
    (entry,) = manifest["entries"].values()
    assert entry["key"]["backend"] == "inductor" and entry["key"]["model"] == "tiny"
    assert entry["shapes"]["512x512"]["event"] == "disk_hit"
    assert entry["shapes"]["512x512"]["cold_seconds"] == pytest.approx(cold["compile_seconds"], abs=0.01)


def test_cli_png_carries_its_parameters_and_images_match_across_processes(two_processes):
    root, cold, _ = two_processes
    image = Image.open(root / "cold.png")
    assert image.size == (512, 512)
    assert image.text["prompt"] == "a lighthouse at dusk" and image.text["seed"] == "1"
    assert json.loads(image.text["parameters"])["cache_event"] == "compiled"
    assert list(Image.open(root / "warm.png").getdata()) == list(image.getdata())


def test_in_process_inductor_engine_then_memory_hit(two_processes, make_engine, monkeypatch):
    root, _, _ = two_processes
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "cache" / "inductor"))
    engine = make_engine(presets="512x512", backend="inductor", cache_dir=root / "cache")
    from neuron_ui.contract.requests import GenerateRequest

    first = engine.generate(GenerateRequest("x", "512x512", seed=2))
    assert first.cache_event == "disk_hit"
    assert engine.generate(GenerateRequest("y", "512x512", seed=3)).cache_event == "memory_hit"


def test_cli_rejects_bad_input_with_a_clear_message(tmp_path, capsys):
    """In this process (`python -m neuron_ui` exits with what main returns): a new Python cost 4 s for one line."""
    from neuron_ui.cli import main

    code = main(["generate", "--model", "tiny", "--cache-dir", str(tmp_path), "--prompt", "x", "--resolution",
                 "1000x1000", "--compile", "eager"])
    err = capsys.readouterr().err
    assert code == 2
    assert "error: resolution 1000x1000: width 1000 is not a multiple of 16" in err
    assert "Traceback" not in err
