"""Neuron 2.34 with stand-ins: the compile key names the Neuron releases (a distribution's metadata on sys.path, as
pip leaves it), and a failed compile with a stand-in torch_neuronx whose `neuron` backend raises, as 2.34's does by
default, or runs the graph eagerly, as it does with TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=0. Nothing here has
Trainium: these test the choices our code makes, not the compiler."""

import sys
import tempfile
from pathlib import Path

import pytest
from test_bundles import fabricate, snapshot

from neuron_ui.cache.bundle_export import export_bundle
from neuron_ui.cache.bundle_format import BundleError, HeaderPeek
from neuron_ui.cache.bundle_import import import_bundle
from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.compile.key import CompileKey
from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.contract.results import CacheEvent

NEFF = {"neff/neuronxcc-abc/model.neff": b"a NEFF of one release", "inductor/fxgraph/kp/entry/0": b"its graph"}


@pytest.fixture
def key_under(tmp_path):
    """key_under(torch_neuronx, neuronx_cc): this machine's compile key with those Neuron releases installed."""

    def key(torch_neuronx: str | None = None, neuronx_cc: str | None = None) -> CompileKey:
        site = tempfile.mkdtemp(dir=tmp_path, prefix="site-")  # a fresh folder: metadata's finder caches per folder
        for name, version in (("torch-neuronx", torch_neuronx), ("neuronx-cc", neuronx_cc)):
            if version is not None:
                info = Path(site) / f"{name.replace('-', '_')}-{version}.dist-info"
                info.mkdir()
                (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        sys.path.insert(0, site)
        try:
            return CompileKey.current("tiny", "regional", "neuron", "bfloat16")
        finally:
            sys.path.remove(site)

    return key


def test_the_key_names_the_neuron_releases_and_each_one_is_another_key(key_under):
    key = key_under("2.14.3.1", "2.22.12471.0")
    assert (key.torch_neuronx, key.neuronx_cc) == ("2.14.3.1", "2.22.12471.0")
    assert key.as_dict()["torch_neuronx"] == "2.14.3.1" and key.as_dict()["neuronx_cc"] == "2.22.12471.0"
    others = [key_under("2.13.3.1", "2.22.12471.0"), key_under("2.14.3.1", "2.21.33363.0"), key_under()]
    assert len({key.digest, *(other.digest for other in others)}) == 4


def test_a_key_without_neuron_keeps_the_digest_it_had(tmp_path):
    """A CPU or CUDA machine (no torch-neuronx) files its shapes where it did before the versions joined the key."""
    key = CompileKey("tiny", "regional", "inductor", "float32", "2.13", "0.42.1")
    assert key.as_dict() == {"model": "tiny", "mode": "regional", "backend": "inductor", "dtype": "float32",
                             "torch": "2.13", "diffusers": "0.42.1", "tp_degree": 1, "cpu_threads": "any"}
    assert key.digest == "7cb652db7a25c200"  # as filed by the manifest before this change
    manifest = CacheManifest(tmp_path / "manifest.json")
    manifest.record(key, "256x256", 256, 2.0, CacheEvent.COMPILED)
    assert CacheManifest(tmp_path / "manifest.json").shapes(key)["256x256"].tokens == 256  # read back: schema-valid


def test_the_manifest_never_takes_another_neuron_releases_shape_for_a_hit(key_under, tmp_path):
    made, here = key_under("2.13.3.1", "2.22.1"), key_under("2.14.3.1", "2.22.1")
    CacheManifest(tmp_path / "manifest.json").record(made, "256x256", 256, 600.0, CacheEvent.COMPILED)
    manifest = CacheManifest(tmp_path / "manifest.json")
    assert manifest.shapes(here) == {} and list(manifest.shapes(made)) == ["256x256"]
    assert manifest.entries()[made.digest]["key"]["torch_neuronx"] == "2.13.3.1"


@pytest.mark.parametrize("made_with, here_with, words", [
    (("2.13.3.1", "2.22.1"), ("2.14.3.1", "2.22.1"), "made with torch-neuronx 2.13.3.1, this machine has 2.14.3.1: "),
    (("2.14.3.1", "2.21.0"), ("2.14.3.1", "2.22.1"), "made with neuronx-cc 2.21.0, this machine has 2.22.1: "),
    ((None, None), ("2.14.3.1", "2.22.1"), "made with torch-neuronx (none), this machine has 2.14.3.1: "),
])
def test_a_bundle_of_another_neuron_release_is_refused_in_one_line(key_under, tmp_path, made_with, here_with, words):
    made, here = key_under(*made_with), key_under(*here_with)
    source = fabricate(tmp_path / "source", {made: ["256x256"]}, NEFF)
    bundle = tmp_path / "bundle.tar.gz"
    info = export_bundle(source, made, bundle)
    assert info.header()["key"].get("torch_neuronx") == made_with[0]  # the bundle names its release
    target = configure_cache_env(tmp_path / "target", environ={})
    before = snapshot(target.root)

    with pytest.raises(BundleError) as refused:
        import_bundle(target, here, bundle)

    message = str(refused.value)
    assert message.startswith(f"{bundle} was {words}") and "\n" not in message, message
    assert "nothing was changed" in message
    assert snapshot(target.root) == before and CacheManifest(target.manifest).shapes(here) == {}
    peek = HeaderPeek(here, "https://example.org/bundle.tar.gz")  # a fetched one: refused from its first bytes
    with pytest.raises(BundleError, match=words.replace("(", r"\(").replace(")", r"\)")):
        peek.feed(bundle.read_bytes())


def test_the_same_neuron_release_imports_as_before(key_under, tmp_path):
    made, here = key_under("2.14.3.1", "2.22.1"), key_under("2.14.3.1", "2.22.1")
    source = fabricate(tmp_path / "source", {made: ["256x256"]}, NEFF)
    export_bundle(source, made, tmp_path / "bundle.tar.gz")
    target = configure_cache_env(tmp_path / "target", environ={})
    assert import_bundle(target, here, tmp_path / "bundle.tar.gz").added_shapes == ["256x256"]
    assert (target.neff / "neuronxcc-abc" / "model.neff").read_bytes() == NEFF["neff/neuronxcc-abc/model.neff"]
