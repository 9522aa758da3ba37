"""manifest.json comes from outside this process (another version, a hand edit, a hostile neighbour): every read
goes through one schema, a bad record is dropped with a warning naming it, and the app always starts."""

import json
import logging

import pytest
from serving import served

from neuron_ui.cache.admin import list_cache
from neuron_ui.cache.manifest import MAX_JSON_DEPTH, MAX_MANIFEST_BYTES, CacheManifest, load_json
from neuron_ui.compile.key import CompileKey
from neuron_ui.config.cache_paths import configure_cache_env

KEY = CompileKey.current("tiny", "regional", "eager", "float32")  # what served() compiles under
GOOD = {"resolution": "256x256", "tokens": 256, "seconds": 1.5, "cold_seconds": 1.5, "event": "compiled",
        "date": "2026-01-01T00:00:00+0000"}
OTHER = {**GOOD, "resolution": "384x256", "tokens": 384}
DEEP = "[" * 200_000 + "]" * 200_000


def without(record: dict, name: str) -> dict:
    return {k: v for k, v in record.items() if k != name}


BAD = {  # what: (the record's name, the record, what the warning must say)
    "a missing field": ("256x256", without(GOOD, "seconds"), "'seconds' is missing"),
    "a wrong type": ("256x256", {**GOOD, "seconds": "abc"}, "'seconds' must be a number"),
    "a negative time": ("256x256", {**GOOD, "cold_seconds": -1}, "'cold_seconds' must be a number"),
    "a boolean for a count": ("256x256", {**GOOD, "tokens": True}, "'tokens' must be a whole number"),
    "a hostile name": ("../../../etc/x", {**GOOD, "resolution": "<script>alert(1)</script>"}, "WIDTHxHEIGHT"),
    "a hostile resolution": ("256x256", {**GOOD, "resolution": "<script>alert(1)</script>"}, "'resolution'"),
    "tokens not the resolution's": ("256x256", {**GOOD, "tokens": 999}, "'tokens' is 999"),
    "markup in the event": ("256x256", {**GOOD, "event": "<b>hit</b>"}, "'event'"),
    "not a mapping": ("256x256", [1, 2], "not a mapping"),
    "a list for the date": ("256x256", {**GOOD, "date": [[["2026"]]]}, "'date'"),
}


def write_manifest(root, shapes: dict, key: CompileKey = KEY) -> None:
    entry = {"key": key.as_dict(), "shapes": shapes}
    root.mkdir(parents=True, exist_ok=True)
    (root / "manifest.json").write_text(json.dumps({"version": 1, "entries": {key.digest: entry}}))


def test_a_newer_versions_extra_field_is_ignored(tmp_path):
    write_manifest(tmp_path, {"256x256": {**GOOD, "load_seconds": 0.4, "future": {"a": [1]}}})

    record = CacheManifest(tmp_path / "manifest.json").shapes(KEY)["256x256"]
    assert record.seconds == 1.5 and record.tokens == 256


@pytest.mark.parametrize("what", BAD)
def test_a_bad_record_is_dropped_with_a_warning_naming_it_and_the_rest_kept(what, tmp_path, caplog):
    name, record, reason = BAD[what]
    write_manifest(tmp_path, {name: record, "384x256": OTHER})
    caplog.set_level(logging.WARNING)

    manifest = CacheManifest(tmp_path / "manifest.json")

    assert set(manifest.shapes(KEY)) == {"384x256"}
    assert set(manifest.entries()[KEY.digest]["shapes"]) == {"384x256"}
    assert [s.resolution for s in list_cache(configure_cache_env(tmp_path, environ={})).keys[0].shapes] == ["384x256"]
    assert repr(name) in caplog.text and reason in caplog.text
    assert "<script>" not in json.dumps(manifest.entries())


def test_an_entry_whose_digest_is_not_its_key_is_dropped(tmp_path, caplog):
    write_manifest(tmp_path, {"256x256": GOOD})
    data = json.loads((tmp_path / "manifest.json").read_text())
    data["entries"]["0123456789abcdef"] = data["entries"].pop(KEY.digest)
    (tmp_path / "manifest.json").write_text(json.dumps(data))

    assert CacheManifest(tmp_path / "manifest.json").entries() == {}
    assert "0123456789abcdef" in caplog.text and "does not match its key" in caplog.text


@pytest.mark.parametrize("text", [DEEP, json.dumps({"version": 1, "entries": {KEY.digest: {"key": {}, "shapes": {
    "256x256": {**GOOD, "date": "@"}}}}}).replace('"@"', DEEP)], ids=["whole", "inside a record"])
def test_a_deeply_nested_manifest_is_ignored_not_a_recursion_error(text, tmp_path, caplog):
    (tmp_path / "manifest.json").write_text(text)

    manifest = CacheManifest(tmp_path / "manifest.json")

    assert manifest.entries() == {} and manifest.shapes(KEY) == {}
    assert "nests" in caplog.text and str(MAX_JSON_DEPTH) in caplog.text


def test_an_oversized_manifest_is_ignored_before_parsing(tmp_path, caplog):
    (tmp_path / "manifest.json").write_bytes(b"{" + b" " * MAX_MANIFEST_BYTES + b"}")

    assert CacheManifest(tmp_path / "manifest.json").entries() == {}
    assert "more than" in caplog.text


def test_load_json_bounds_depth_and_size_whatever_the_strings_hold():
    assert load_json(b'{"a": "[[[[[[[[", "b": [1, {"c": "\\"]]]]"}]}', "x", 1000, max_depth=3) == {
        "a": "[[[[[[[[", "b": [1, {"c": '"]]]]'}]}
    with pytest.raises(ValueError, match="nests 3 levels"):
        load_json(b'[[["a"]]]', "x", 1000, max_depth=2)
    with pytest.raises(ValueError, match="nests 51 levels"):  # an escaped quote does not end its string early
        load_json(b'["\\"", ' + b"[" * 50 + b"]" * 50 + b"]", "x", 1000, max_depth=10)
    with pytest.raises(ValueError, match="more than the 10 bytes"):
        load_json(b"[" + b" " * 10 + b"]", "x", 10)


MIXED = {"256x256": {**GOOD, "load_seconds": 0.4}, "384x256": {**OTHER, "seconds": "abc"},
         "../../../etc/x": {**GOOD, "resolution": "<script>alert(1)</script>"}}


@pytest.mark.parametrize("manifest", ["mixed records", "deeply nested"])
def test_the_app_starts_on_whatever_manifest_is_on_disk(manifest, tmp_path, caplog):
    cache = tmp_path / "cache"
    if manifest == "mixed records":
        write_manifest(cache, MIXED)
    else:
        cache.mkdir()
        (cache / "manifest.json").write_text(DEEP)
    caplog.set_level(logging.WARNING)

    with served(cache) as s:
        assert s.get("/healthz").status_code == 200
        shapes = {shape.resolution: shape for shape in s.engine.status().shapes}
        assert shapes["256x256"].on_disk is (manifest == "mixed records")  # the extra field is ignored
        assert not shapes["384x256"].on_disk
        assert "alert(1)" not in s.get("/").text

    assert ("'384x256'" in caplog.text and "'seconds'" in caplog.text) if manifest == "mixed records" else (
        "nests" in caplog.text)


def test_editing_layout_records_pass_the_schema_and_wrong_token_counts_do_not(tmp_path):
    """The engine records editing graphs under their layout's name; the schema keeps them and checks their tokens."""
    key = CompileKey("tiny", "regional", "inductor", "float32", "2.13", "0.42.1")
    manifest = CacheManifest(tmp_path / "manifest.json")
    manifest.record(key, "256x256 + 1 ref 512x512", 256 + 1024, 3.0, "compiled")
    manifest.record(key, "inpaint 256x256", 512, 2.0, "compiled")
    assert set(CacheManifest(tmp_path / "manifest.json").shapes(key)) == {"256x256 + 1 ref 512x512", "inpaint 256x256"}
    data = json.loads((tmp_path / "manifest.json").read_text())
    data["entries"][key.digest]["shapes"]["inpaint 256x256"]["tokens"] = 256  # an inpaint graph is twice the output
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    assert set(CacheManifest(tmp_path / "manifest.json").shapes(key)) == {"256x256 + 1 ref 512x512"}
