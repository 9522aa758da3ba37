"""Device choice with a stand-in for torch_neuronx: the hardware is not here, the choices the code makes are."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from neuron_ui.config.cache_paths import NEFF_CACHE_ENV, configure_cache_env
from neuron_ui.config.runtime import Runtime, detect_device, probe_device

FAKE_TORCH_NEURONX = textwrap.dedent(
    """
    # Stand-in for torch_neuronx: importing it registers torch.neuron, as the real package does.
    import torch

    class _Neuron:
        def is_available(self):
            return True

        def current_device(self):
            return 0

    torch.neuron = _Neuron()
    """
)


@pytest.fixture
def fake_neuron(tmp_path, monkeypatch):
    package = tmp_path / "torch_neuronx"
    package.mkdir()
    (package / "__init__.py").write_text(FAKE_TORCH_NEURONX)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("torch_neuronx", None)
    if hasattr(torch, "neuron"):
        del torch.neuron


def test_cuda_then_cpu_without_neuron():
    on_cuda = torch.cuda.is_available()
    expected = Runtime("cuda", "bfloat16", "inductor") if on_cuda else Runtime("cpu", "float32", "inductor")
    assert Runtime.detect() == expected


def test_neuron_is_chosen_first_with_bf16_and_the_neuron_backend(fake_neuron):
    # With TORCH_DEVICE_BACKEND_AUTOLOAD=0 nothing imported torch_neuronx: detect_device must import it.
    assert "torch_neuronx" not in sys.modules
    assert Runtime.detect() == Runtime("neuron", "bfloat16", "neuron")
    assert "torch_neuronx" in sys.modules
    assert Runtime.detect(backend="inductor", dtype="float32").backend == "inductor"


def test_explicit_device_that_is_missing_fails_clearly():
    with pytest.raises(RuntimeError, match="torch_neuronx is not installed"):
        detect_device("neuron")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            detect_device("cuda")


def test_cache_env_points_inside_the_cache_folder(tmp_path):
    env = {}
    paths = configure_cache_env(tmp_path / "cache", env)
    assert env[NEFF_CACHE_ENV] == str(tmp_path / "cache" / "neff") == str(paths.neff)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    assert paths.neff.is_dir() and paths.inductor.is_dir()


def test_a_users_own_neff_cache_dir_wins(tmp_path):
    env = {NEFF_CACHE_ENV: str(tmp_path / "mine")}
    assert configure_cache_env(tmp_path / "cache", env).neff == tmp_path / "mine"


def test_cache_env_is_set_before_torch_is_imported(tmp_path):
    """torch loads torch_neuronx at import, which reads the NEFF cache variable then."""
    code = textwrap.dedent(
        f"""
        import os, sys
        from neuron_ui.config.cache_paths import configure_cache_env
        configure_cache_env({str(tmp_path)!r})
        assert "torch" not in sys.modules, "configuring the cache imported torch"
        import torch
        print(os.environ["{NEFF_CACHE_ENV}"])
        """
    )
    env = {k: v for k, v in os.environ.items() if k != NEFF_CACHE_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == str(tmp_path / "neff")


def test_an_unusable_cache_folder_sends_the_compilers_to_a_temp_folder(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    env = {}
    paths = configure_cache_env(blocker / "cache", env)
    assert paths.problem and "is not usable" in paths.problem
    assert paths.inductor.is_dir() and not paths.inductor.is_relative_to(blocker)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(paths.inductor)


def test_the_replica_health_probe_passes_on_a_working_device_and_raises_on_a_missing_one():
    """What EngineReplica.check_health runs on an idle replica: Serve replaces a replica whose check raises."""
    probe_device("cpu")
    missing = "cuda" if not torch.cuda.is_available() else "meta"
    with pytest.raises(Exception):  # noqa: B017  (torch raises RuntimeError or AssertionError, by build)
        probe_device(missing)
