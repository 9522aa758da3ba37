"""`--compile aot`: real AOTInductor packages on the tiny model on CPU.

The suite's one cold process compiles the packages into a shared cache folder (conftest's aot_compiled_here); a
second, new process loads them from a copy without dynamo; the other tests copy that folder and damage it (one block
class compiled again; a package of another key and one cut short are checked on the store, without compiling), or
ship it in a bundle.
"""

import logging
import shutil
import dataclasses
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from cold_cache import AOT_REQUEST, RESOLUTION, run_aot_child
from PIL import Image
from runners import local_engine

from neuron_ui.cache.admin import key_for_settings
from neuron_ui.cache.bundle_export import export_bundle
from neuron_ui.cache.bundle_import import import_bundle
from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.compile import aot
from neuron_ui.compile.key import CompileKey
from neuron_ui.contract.results import CacheEvent
from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.resolutions import parse_resolutions
from neuron_ui.config.runtime import Runtime
from neuron_ui.config.settings import Settings
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.results import EngineStatus
from neuron_ui.engine.engine import Engine
from neuron_ui.main import main
from neuron_ui.model.loading import LoadedModel
from neuron_ui.model.tiny import build_tiny_pipeline
from neuron_ui.ui.words import describe_engine

pytestmark = pytest.mark.slow

REQUEST = AOT_REQUEST  # the cold process's request: an image here compares with its image pixel for pixel
# Pixels (0-255) an aot image may differ from regional torch.compile's for the same seed: both are inductor
# kernels, but AOTInductor takes the weights as inputs and fuses differently, so float32 sums round differently.
TOLERANCE = 2

@pytest.fixture(scope="module")
def warm(aot_compiled_here, tmp_path_factory):
    """The suite's cold process compiled the packages (conftest's aot_compiled_here); a new process loads them from a
    copy of its folder (the shared one is never changed)."""
    shared, cold = aot_compiled_here
    root = tmp_path_factory.mktemp("aot")
    shutil.copytree(shared, root, dirs_exist_ok=True)
    warm = run_aot_child(root / "cache", root / "warm.png")
    return root, cold, warm


def pixels(image) -> np.ndarray:
    image = Image.open(image) if isinstance(image, Path) else image
    return np.asarray(image.convert("RGB")).astype(int)


def aot_engine(cache_dir: Path, name: str = "tiny") -> Engine:
    cache = configure_cache_env(cache_dir, environ={})
    return local_engine(LoadedModel(build_tiny_pipeline(), name=name, is_tiny=True),
                        presets=parse_resolutions(RESOLUTION),
                        compile_mode="aot", backend="inductor", cache=cache, manifest=CacheManifest(cache.manifest))


def cold_key() -> CompileKey:
    """The compile key the child processes' engines compiled under."""
    settings = Settings(model="tiny", device="cpu", compile="aot", resolutions=parse_resolutions(RESOLUTION))
    return key_for_settings(settings)


def packages(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "aot").rglob("*.pt2"))


def test_cold_process_compiles_one_package_per_block_class(warm):
    root, cold, _ = warm
    assert cold["events"] == [CacheEvent.COMPILED, CacheEvent.MEMORY_HIT]
    assert cold["status_mode"] == "aot"
    names = [p.name.split("-")[0] for p in packages(root / "cache")]
    assert names == ["Flux2SingleTransformerBlock", "Flux2TransformerBlock"]  # 2 + 4 blocks, 2 packages
    assert cold["traced"]["graphs"] == 0  # export is not dynamo: nothing is traced by torch.compile


def test_new_process_loads_packages_without_dynamo(warm):
    root, cold, warm_run = warm
    assert warm_run["events"] == [CacheEvent.DISK_HIT, CacheEvent.MEMORY_HIT]
    assert warm_run["traced"] == {"frames": 0, "graphs": 0}
    assert warm_run["control_frames"] > 0  # the counter does count dynamo's frames when it traces
    assert warm_run["compile_s"] < cold["compile_s"] / 3, (warm_run, cold)
    assert (pixels(root / "warm.png") == pixels(root / "cold.png")).all()  # the same package, the same kernels


def test_images_match_regional_torch_compile(warm, compiled_here, make_engine, tmp_path, monkeypatch):
    """Regional torch.compile's image from a copy of the suite's cold regional folder (conftest's compiled_here, the
    same graphs at this size): inductor's disk cache gives the kernels a cold compile would, without the compile."""
    root, _, _ = warm
    shutil.copytree(compiled_here[0], tmp_path / "regional")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "regional" / "inductor"))
    regional = make_engine(presets=RESOLUTION, compile_mode="regional", backend="inductor",
                           cache_dir=tmp_path / "regional")
    image = regional.generate(GenerateRequest(**REQUEST)).image
    difference = np.abs(pixels(image) - pixels(root / "cold.png"))
    assert difference.max() <= TOLERANCE, difference.max()


def test_an_unreadable_package_is_compiled_again_beside_a_whole_one_that_loads(warm, tmp_path, caplog):
    """One engine of the cold run's key finds, in its own folder, the cold run's double-stream package (whole) and a
    single-stream file that is not a package: it loads the first, compiles the second again (one block class's
    compile, the cheaper one), the image is the cold run's, and a new engine loads both."""
    caplog.set_level(logging.INFO, logger="neuron_ui.compile.aot")
    root, _, _ = warm
    engine = aot_engine(tmp_path / "cache")
    single, double = packages(root / "cache")
    ours = aot.package_folder(engine.runner.cache, engine.runner.key)
    ours.mkdir(parents=True)
    shutil.copy(double, ours / double.name)
    (ours / single.name).write_bytes(b"not a package")
    result = engine.generate(GenerateRequest(**REQUEST))
    assert result.cache_event == CacheEvent.COMPILED
    assert f"ignoring unreadable AOT package {ours / single.name}" in caplog.text
    assert f"loaded AOT package {double.name}" in caplog.text and f"compiled AOT package {single.name}" in caplog.text
    assert [p.name for p in packages(tmp_path / "cache")] == [single.name, double.name]
    assert (pixels(result.image) == pixels(root / "cold.png")).all()
    torch._dynamo.reset()
    again = aot_engine(tmp_path / "cache").generate(GenerateRequest(**REQUEST))
    assert again.cache_event == CacheEvent.DISK_HIT  # the rewritten package loads


def test_a_package_of_another_compile_key_is_compiled_again(warm, tmp_path, caplog):
    """The store of another key (another model name) on its own, given the cold run's whole package under the same
    name (same block, same shapes; only the key inside differs): it goes to export and compile (no compile here: the
    engine-level test above pays one)."""
    root, _, _ = warm
    package = packages(root / "cache")[0]
    name, signature = package.stem.rsplit("-", 1)
    other = dataclasses.replace(cold_key(), model="tiny-other")
    shutil.copy(package, tmp_path / package.name)
    with pytest.raises(Exported):
        aot.PackageStore(tmp_path, other).get(name, signature, must_not_compile)
    assert f"ignoring AOT package {tmp_path / package.name}: built for key {cold_key().digest}" in caplog.text


class Exported(Exception):
    """Raised by the export a store calls only when it must compile: it got as far as compiling."""


def must_not_compile() -> torch.export.ExportedProgram:
    raise Exported


def test_a_package_cut_short_is_compiled_again_and_a_whole_one_is_not(warm, tmp_path):
    """The store on its own (no compile here: the engine-level test above pays one): a package cut short goes to
    export and compile; the same package whole loads."""
    root, _, _ = warm
    key = cold_key()
    package = packages(root / "cache")[0]
    name, signature = package.stem.rsplit("-", 1)
    whole = aot.PackageStore(root / "cache" / "aot" / key.digest, key)
    assert whole.path(name, signature) == package
    assert whole.get(name, signature, must_not_compile) is not None  # loads: the control
    shutil.copy(package, tmp_path / package.name)
    short = tmp_path / package.name
    short.write_bytes(short.read_bytes()[: short.stat().st_size // 2])
    with pytest.raises(Exported):
        aot.PackageStore(tmp_path, key).get(name, signature, must_not_compile)


def test_bundle_carries_the_packages(warm, tmp_path):
    root, _, _ = warm
    key = cold_key()
    exported = export_bundle(configure_cache_env(root / "cache", environ={}), key, tmp_path / "b.tar.gz")
    assert sorted(f.path for f in exported.files) == [
        f"aot/{key.digest}/{p.name}" for p in packages(root / "cache")]  # its packages only, no inductor folder
    fresh = configure_cache_env(tmp_path / "fresh", environ={})
    import_bundle(fresh, key, exported.path)
    result = aot_engine(tmp_path / "fresh").generate(GenerateRequest(**REQUEST))
    assert result.cache_event == CacheEvent.DISK_HIT
    assert (pixels(result.image) == pixels(root / "cold.png")).all()


def test_aot_is_refused_on_neuron_with_a_clear_message():
    with pytest.raises(ValueError, match="CUDA and CPU"):
        Settings(compile="aot", device="neuron")
    with pytest.raises(ValueError, match="--compile regional"):
        aot.check_runtime("neuron", "neuron")
    with pytest.raises(ValueError, match="tensor-parallel"):
        aot.check_runtime("cuda", "inductor", tp_degree=2)
    aot.check_runtime("cuda", "inductor")


def test_status_line_names_the_aot_mode():
    fields = {f: None for f in EngineStatus.__dataclass_fields__}
    status = replace(EngineStatus(**fields), model="tiny", device="cpu", dtype="float32", compile_mode="aot",
                     compile_backend="inductor")
    assert "**Compile** ahead-of-time (AOTInductor packages)" in describe_engine(status, Settings())


def test_an_auto_detected_neuron_device_stops_aot_at_start_up_in_one_line(tmp_path):
    """No Trainium here: main is given the runtime auto-detection would choose on one, the rest is app.py's own
    start-up (refused before the server starts or a signal handler is set)."""
    on_trainium = Runtime("neuron", "bfloat16", "neuron")
    with pytest.raises(SystemExit) as stopped:
        main(["--compile", "aot", "--model", "tiny", "--cache-dir", str(tmp_path), "--port", "0",
              "--host", "127.0.0.1"], runtime=on_trainium)
    assert str(stopped.value.code).startswith("error: --compile aot (AOTInductor packages) is for CUDA and CPU")
