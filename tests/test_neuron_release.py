"""Neuron 2.34 with stand-ins: the compile key names the Neuron releases (a distribution's metadata on sys.path, as
pip leaves it), and a failed compile with a stand-in torch_neuronx whose `neuron` backend raises, as 2.34's does by
default, or runs the graph eagerly, as it does with TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=0. Nothing here has
Trainium: these test the choices our code makes, not the compiler."""

import logging
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from test_bundles import fabricate, snapshot

from neuron_ui.cache.bundle_export import export_bundle
from neuron_ui.cache.bundle_format import BundleError, HeaderPeek
from neuron_ui.cache.bundle_import import import_bundle
from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.compile.key import CompileKey
from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.runtime import NEURON_FALLBACK_ENV, Runtime
from neuron_ui.config.settings import Settings
from neuron_ui.contract.errors import EngineError, ErrorKind
from neuron_ui.contract.requests import GenerateRequest
from neuron_ui.contract.results import CacheEvent
from neuron_ui.ui.words import describe_cache_event, describe_engine, describe_size

FALLBACK_WORDS = f"{NEURON_FALLBACK_ENV}=0: a graph that fails to compile may run eagerly, unreported"
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


# -- a failed compile, with a stand-in torch_neuronx --------------------------------------------------------------

STAND_IN = textwrap.dedent(
    f"""
    # Stand-in for torch_neuronx 2.34: importing it registers torch.neuron and the `neuron` compile backend, whose
    # compiler fails here. By default the failure raises; with {NEURON_FALLBACK_ENV}=0 the graph runs eagerly and
    # nothing says so, as the real one does.
    import os
    import torch

    class _Neuron:
        def is_available(self):
            return True

    torch.neuron = _Neuron()

    @torch._dynamo.register_backend(name="neuron")
    def neuron(gm, example_inputs):
        try:
            raise RuntimeError("neuronx-cc failed: NCC_INLA001 injected compiler failure")
        except RuntimeError:
            if os.environ.get("{NEURON_FALLBACK_ENV}", "1") == "0":
                return gm.forward
            raise
    """
)


@pytest.fixture
def neuron_stand_in(tmp_path, monkeypatch):
    package = tmp_path / "stand-in" / "torch_neuronx"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.delenv(NEURON_FALLBACK_ENV, raising=False)
    assert Runtime.detect() == Runtime("neuron", "bfloat16", "neuron")  # imports the stand-in, as start-up does
    yield
    from torch._dynamo.backends import registry  # what the stand-in's import registered, taken back

    registry._COMPILER_FNS.pop("neuron", None)
    registry._BACKENDS.pop("neuron", None)
    sys.modules.pop("torch_neuronx", None)
    del torch.neuron


def gen(engine, resolution="256x256"):
    return engine.generate(GenerateRequest("a lighthouse", resolution, seed=7))


def test_a_failed_neuron_compile_shows_the_size_failed_with_the_reason(neuron_stand_in, make_engine):
    engine = make_engine(backend="neuron")
    with pytest.raises(EngineError, match="compiling 256x256 failed: .*NCC_INLA001 injected") as error:
        gen(engine)
    assert error.value.kind == ErrorKind.COMPILE_FAILED
    shape = engine.status().shape("256x256")
    assert shape.state == "failed" and "NCC_INLA001 injected compiler failure" in shape.error
    assert "**Failed to compile** **256x256** (" in describe_size(shape) and "NCC_INLA001" in describe_size(shape)
    assert NEURON_FALLBACK_ENV not in describe_engine(engine.status(), Settings())  # the default: nothing to warn


def test_with_fallback_on_the_header_and_each_cache_event_say_a_graph_may_run_eagerly(
        neuron_stand_in, make_engine, monkeypatch, caplog):
    monkeypatch.setenv(NEURON_FALLBACK_ENV, "0")
    with caplog.at_level(logging.WARNING, logger="neuron_ui.compile.strategies"):
        engine = make_engine(backend="neuron")
    assert FALLBACK_WORDS in caplog.text
    first, again = gen(engine), gen(engine)  # the compile failed; the stand-in ran the graph eagerly, unreported
    assert engine.status().shape("256x256").state == "ready"  # what the fallback hides: hence the words
    assert FALLBACK_WORDS in describe_engine(engine.status(), Settings())
    assert {first.cache_event, again.cache_event} == {CacheEvent.DISK_HIT, CacheEvent.MEMORY_HIT}
    for result in (first, again):
        assert describe_cache_event(result).endswith(f"({FALLBACK_WORDS})")
    monkeypatch.setenv(NEURON_FALLBACK_ENV, "1")
    assert FALLBACK_WORDS not in describe_cache_event(again)
    assert NEURON_FALLBACK_ENV not in describe_engine(engine.status(), Settings())


def test_the_fallback_words_stay_off_other_backends_and_eager(monkeypatch):
    from neuron_ui.config.runtime import eager_fallback_note

    monkeypatch.setenv(NEURON_FALLBACK_ENV, "0")
    assert eager_fallback_note("neuron") == FALLBACK_WORDS
    assert eager_fallback_note("inductor") == ""
    for unset_or_default in ("", "1", "true"):
        assert eager_fallback_note("neuron", {NEURON_FALLBACK_ENV: unset_or_default}) == ""
    assert eager_fallback_note("neuron", {}) == ""
