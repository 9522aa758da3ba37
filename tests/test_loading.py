import logging
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from neuron_ui.model.hub import TINY, ModelChoice, choose_model
from neuron_ui.model.loading import load_model
from neuron_ui.model.tiny import build_tiny_pipeline


def image_of(pipe, seed=3):
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt="a red kite", height=256, width=256, num_inference_steps=2, guidance_scale=1.0,
               generator=torch.Generator("cpu").manual_seed(seed), output_type="np")
    return out.images[0]


def test_tiny_pipeline_is_klein_shaped_and_deterministic():
    pipe = build_tiny_pipeline()
    assert type(pipe).__name__ == "Flux2KleinPipeline" and pipe.config.is_distilled
    assert len(pipe.transformer.transformer_blocks) + len(pipe.transformer.single_transformer_blocks) >= 4
    assert pipe.vae_scale_factor == 8  # so (h/16)*(w/16) tokens, like the real model
    a, b = image_of(pipe), image_of(build_tiny_pipeline())
    assert a.shape == (256, 256, 3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, image_of(pipe, seed=4))


def test_saved_pipeline_loads_back_from_a_folder(tmp_path):
    pipe = build_tiny_pipeline()
    pipe.save_pretrained(tmp_path / "klein-tiny")
    choice = choose_model(str(tmp_path / "klein-tiny"))
    assert choice == ModelChoice(str(tmp_path / "klein-tiny"), str(tmp_path / "klein-tiny"))
    loaded = load_model(choice, torch.float32)
    assert not loaded.is_tiny and loaded.distilled
    np.testing.assert_allclose(image_of(loaded.pipe), image_of(pipe), atol=1e-6)


@pytest.fixture
def silent_hub():
    """A 'Hub' that accepts connections and never answers, like a black-holed network."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted = []

    def serve():
        while True:
            try:
                accepted.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    server.close()
    for conn in accepted:
        conn.close()


def test_auto_falls_back_to_tiny_quickly_when_the_hub_does_not_answer(silent_hub, monkeypatch):
    import huggingface_hub.constants

    endpoint, accepted = silent_hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    start = time.monotonic()
    choice = choose_model("auto", hub_timeout=1.0)
    assert time.monotonic() - start < 5
    assert accepted, "the probe never reached the (silent) hub"
    assert choice.source == TINY and "did not answer" in choice.fallback_reason


def test_auto_offline_falls_back_without_touching_the_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert choose_model("auto").source == TINY


def test_offline_says_so_once_on_a_warm_boot(monkeypatch, tmp_path, caplog):
    """A warm boot decides `--model auto` twice (the bundle's compile key, then the engine's model): one line, true."""
    import huggingface_hub.constants

    from neuron_ui.cache.admin import key_for_settings
    from neuron_ui.config.settings import Settings
    from neuron_ui.engine.local import load_for
    from neuron_ui.ui.words import tiny_banner

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing cached here
    settings = Settings(model="auto", device="cpu", cache_dir=tmp_path / "cache")

    key_for_settings(settings)  # what import_at_start computes before the engine loads
    loaded, _ = load_for(settings)

    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len([line for line in said if "HF_HUB_OFFLINE" in line]) == 1, said
    assert not any("did not answer" in line for line in said), said
    assert loaded.is_tiny and loaded.fallback_reason == ("HF_HUB_OFFLINE is set, so the Hub was not asked, and "
                                                         "black-forest-labs/FLUX.2-klein-4B is not in the local cache")
    banner = tiny_banner(SimpleNamespace(fallback_reason=loaded.fallback_reason))
    assert "did not answer" not in banner and "HF_HUB_OFFLINE is set" in banner
