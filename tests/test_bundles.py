"""Compile-cache bundles: ls, export, import, clear.

The tests fabricate a cache folder (manifest records plus files). The real warm start from a bundle of a folder
compiled for real (a cold process, then a fresh one from the bundle) is tests/test_bundle_fetch.py's slow test: its
bundle comes from a URL, imported by import_bundle as a local one is, so one fresh process proves both.
"""

import dataclasses
import hashlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from neuron_ui.cache.admin import clear_cache, format_listing, list_cache
from neuron_ui.cache.bundle_export import export_bundle
from neuron_ui.cache.bundle_format import BUNDLE_JSON, BundleError
from neuron_ui.cache.bundle_import import import_bundle
from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.compile.key import CompileKey
from neuron_ui.contract.results import CacheEvent
from neuron_ui.config.cache_paths import configure_cache_env
from neuron_ui.config.resolutions import parse_resolution
from neuron_ui.main import parse_settings
from neuron_ui.serving import build_engine

REPO = Path(__file__).resolve().parents[1]
KEY = CompileKey.current("tiny", "regional", "inductor", "float32")
OTHER_KEY = dataclasses.replace(KEY, mode="full")
# Incompressible, so a cut at any fraction of the .tar.gz lands inside file data.
ARTIFACTS = {
    "inductor/ab/cabkernel.so": os.urandom(40_000),
    "inductor/ab/cabkernel.cpp": b"// generated kernel\n" * 50,
    "inductor/fxgraph/kp/entry/0": os.urandom(20_000),
    "inductor/aotautograd/xy/entry/0": os.urandom(5_000),
}


def fabricate(root: Path, records: dict[CompileKey, list[str]], files: dict[str, bytes] = ARTIFACTS):
    """A cache folder as the engine leaves it: manifest records, artifacts, and inductor's lock files."""
    cache = configure_cache_env(root, environ={})
    manifest = CacheManifest(cache.manifest)
    for key, resolutions in records.items():
        for resolution in resolutions:
            manifest.record(key, resolution, parse_resolution(resolution).tokens, 20.0, CacheEvent.COMPILED)
    for name, data in files.items():
        section, _, rest = name.partition("/")
        path = getattr(cache, section) / rest
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if path.suffix == ".so":
            path.chmod(0o755)
    (cache.inductor / "locks").mkdir(exist_ok=True)
    (cache.inductor / "locks" / "cabkernel.lock").touch()
    return cache


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root with the hash of its bytes (folders too), to prove nothing changed."""
    return {
        str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


def rewrite(bundle: Path, out: Path, edit) -> Path:
    """Copy a bundle member by member through `edit(members) -> members`, to forge damaged ones."""
    with tarfile.open(bundle, "r:gz") as tar:
        members = [(m, tar.extractfile(m).read() if m.isreg() else None) for m in tar.getmembers()]
    with tarfile.open(out, "w:gz") as tar:
        for member, data in edit(members):
            tar.addfile(member, io.BytesIO(data) if data is not None else None)
    return out


def member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = ""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data) if kind == tarfile.REGTYPE else 0
    return info, data if kind == tarfile.REGTYPE else None


@pytest.fixture
def source(tmp_path):
    return fabricate(tmp_path / "source", {KEY: ["256x256", "512x512"], OTHER_KEY: ["256x256"]})


@pytest.fixture
def bundle(source, tmp_path):
    export_bundle(source, KEY, tmp_path / "bundle.tar.gz", ["512x512"])
    return tmp_path / "bundle.tar.gz"


@pytest.fixture
def target(tmp_path):
    """A cache that already holds something of its own, so 'untouched' means something."""
    return fabricate(tmp_path / "target", {OTHER_KEY: ["384x256"]}, {"inductor/zz/own.so": b"own"})


# -- ls ------------------------------------------------------------------------------------------


def test_ls_groups_shapes_by_key_with_sizes(source):
    listing = list_cache(source)

    by_digest = {entry.digest: entry for entry in listing.keys}
    assert set(by_digest) == {KEY.digest, OTHER_KEY.digest}
    assert [s.resolution for s in by_digest[KEY.digest].shapes] == ["256x256", "512x512"]
    assert by_digest[OTHER_KEY.digest].key["mode"] == "full"
    assert listing.folders["inductor"].files == len(ARTIFACTS)  # lock files are not artifacts
    assert listing.folders["inductor"].bytes == sum(len(d) for d in ARTIFACTS.values())
    assert listing.folders["neff"].files == 0

    text = format_listing(listing, current=KEY)
    assert f"* key {KEY.digest}" in text and f"  key {OTHER_KEY.digest}" in text
    assert "512x512" in text and f"torch={KEY.torch}" in text


def test_ls_of_an_empty_cache(tmp_path):
    text = format_listing(list_cache(configure_cache_env(tmp_path / "empty", environ={})))
    assert "no compiled shapes recorded" in text


# -- export and import -----------------------------------------------------------------------------


def test_export_then_import_into_an_empty_cache(source, bundle, tmp_path):
    header = json.loads(tarfile.open(bundle, "r:gz").extractfile(BUNDLE_JSON).read())
    assert header["key"] == KEY.as_dict()
    assert list(header["entries"][KEY.digest]["shapes"]) == ["512x512"]  # only what was asked for
    assert {f["path"] for f in header["files"]} == set(ARTIFACTS)  # the inductor folder whole, locks aside

    empty = configure_cache_env(tmp_path / "empty", environ={})
    info = import_bundle(empty, KEY, bundle)

    assert info.added_shapes == ["512x512"] and info.kept_files == 0
    for name, data in ARTIFACTS.items():
        section, _, rest = name.partition("/")
        assert (getattr(empty, section) / rest).read_bytes() == data
    assert os.access(empty.inductor / "ab" / "cabkernel.so", os.X_OK)
    assert set(CacheManifest(empty.manifest).shapes(KEY)) == {"512x512"}
    assert CacheManifest(empty.manifest).shapes(KEY)["512x512"].cold_seconds == 20.0
    assert not list(empty.root.glob(".import-*"))

    again = import_bundle(empty, KEY, bundle)  # idempotent: everything is already here
    assert again.kept_shapes == ["512x512"] and again.kept_files == len(ARTIFACTS)


def test_export_into_a_folder_names_the_bundle_by_key(source, tmp_path):
    info = export_bundle(source, KEY, tmp_path)

    assert info.path == tmp_path / f"neuron-ui-{KEY.digest}.tar.gz"
    assert tarfile.open(info.path, "r:gz").getnames()[0] == BUNDLE_JSON  # readable without extracting
    seen = import_bundle(configure_cache_env(tmp_path / "fresh", environ={}), KEY, info.path)
    assert seen.resolutions == ["256x256", "512x512"] and seen.key == KEY.as_dict()
    assert seen.bytes == sum(len(d) for d in ARTIFACTS.values())


def test_import_merges_with_what_the_cache_already_has(bundle, target):
    import_bundle(target, KEY, bundle)

    assert set(CacheManifest(target.manifest).shapes(OTHER_KEY)) == {"384x256"}
    assert set(CacheManifest(target.manifest).shapes(KEY)) == {"512x512"}
    assert (target.inductor / "zz" / "own.so").read_bytes() == b"own"


def test_export_refuses_when_nothing_is_compiled_for_the_key(source, tmp_path):
    with pytest.raises(ValueError, match="nothing to export") as error:
        export_bundle(source, dataclasses.replace(KEY, dtype="bfloat16"), tmp_path / "b.tar.gz")
    assert "256x256, 512x512" in str(error.value)  # says what the cache does hold
    with pytest.raises(ValueError, match="nothing compiled at 1024x1024.*compiled: 256x256, 512x512"):
        export_bundle(source, KEY, tmp_path / "b.tar.gz", ["1024x1024"])
    with pytest.raises(ValueError, match="nothing to export"):
        export_bundle(configure_cache_env(tmp_path / "empty", environ={}), KEY, tmp_path / "b.tar.gz")
    aot = dataclasses.replace(KEY, backend="aot_eager")
    CacheManifest(source.manifest).record(aot, "256x256", 256, 3.0, CacheEvent.COMPILED)
    with pytest.raises(ValueError, match="keeps no compiled artifacts"):
        export_bundle(source, aot, tmp_path / "b.tar.gz")
    assert not list(tmp_path.glob("*.tar.gz")) and not list(tmp_path.glob(".b.tar.gz*"))


def test_import_refuses_another_compile_key_naming_each_field(source, target, tmp_path):
    theirs = dataclasses.replace(KEY, torch="2.12.0", dtype="bfloat16")
    fabricate(source.root, {theirs: ["256x256"]})
    export_bundle(source, theirs, tmp_path / "old.tar.gz")
    before = snapshot(target.root)

    with pytest.raises(BundleError) as error:
        import_bundle(target, KEY, tmp_path / "old.tar.gz")

    message = str(error.value)
    assert f"torch: bundle 2.12.0, here {KEY.torch}" in message
    assert "dtype: bundle bfloat16, here float32" in message
    assert "mode:" not in message and "model:" not in message  # only the fields that differ
    assert snapshot(target.root) == before


def _truncated(bundle: Path, fraction: float) -> Path:
    data = bundle.read_bytes()
    out = bundle.with_name(f"cut-{fraction}.tar.gz")
    out.write_bytes(data[: int(len(data) * fraction)])
    return out


def _not_gzip(bundle: Path) -> Path:
    out = bundle.with_name("junk.tar.gz")
    out.write_bytes(b"PK\x03\x04 a zip file, say")
    return out


def _flip_a_byte(members):
    for info, data in members:
        if info.name.endswith(".so"):
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        yield info, data


DAMAGED = {  # name: (make a damaged copy from a good bundle, what the refusal must say)
    "cut in the middle": (lambda b, t: _truncated(b, 0.5), "truncated"),
    "cut in the last bytes": (lambda b, t: _truncated(b, 0.9999), "truncated"),
    "not gzip": (lambda b, t: _not_gzip(b), "corrupt"),
    "checksum mismatch": (lambda b, t: rewrite(b, t / "x.tar.gz", _flip_a_byte), "cabkernel.so does not match"),
    "no bundle.json": (lambda b, t: rewrite(b, t / "x.tar.gz", lambda ms: ms[1:]), "does not start with bundle.json"),
    "a listed file missing": (lambda b, t: rewrite(b, t / "x.tar.gz", lambda ms: ms[:-1]), "lacks 1 listed file"),
    "an unlisted file": (lambda b, t: rewrite(b, t / "x.tar.gz", lambda ms: ms + [member("inductor/extra", b"x")]),
                         "does not list"),
    "absolute path": (lambda b, t: rewrite(b, t / "x.tar.gz", lambda ms: ms + [member("/tmp/evil", b"x")]),
                      "unsafe or unexpected path '/tmp/evil'"),
    "dot-dot path": (lambda b, t: rewrite(b, t / "x.tar.gz", lambda ms: ms + [member("inductor/../../evil", b"x")]),
                     "unsafe or unexpected path"),
    "symlink": (lambda b, t: rewrite(b, t / "x.tar.gz", lambda ms: ms + [
        member("inductor/ln", kind=tarfile.SYMTYPE, link="/etc/passwd")]), "not a plain file"),
    "hard link": (lambda b, t: rewrite(b, t / "x.tar.gz", lambda ms: ms + [
        member("inductor/hl", kind=tarfile.LNKTYPE, link="inductor/ab/cabkernel.so")]), "not a plain file"),
}


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_damaged_bundle_is_refused_and_the_cache_untouched(damage, bundle, target, tmp_path):
    make, reason = DAMAGED[damage]
    bad = make(bundle, tmp_path)
    before = snapshot(target.root)

    with pytest.raises(BundleError, match="nothing was changed") as error:
        import_bundle(target, KEY, bad)

    assert reason in str(error.value)
    assert snapshot(target.root) == before
    assert not (tmp_path / "tmp").exists() and not (tmp_path / "evil").exists()


def test_a_missing_bundle_file_is_refused_plainly(target, tmp_path):
    before = snapshot(target.root)
    with pytest.raises(BundleError, match="not a readable bundle.*FileNotFoundError"):
        import_bundle(target, KEY, tmp_path / "never-copied.tar.gz")
    assert snapshot(target.root) == before


# -- what bundle.json may say ---------------------------------------------------------------------

DEEP = ("[" * 200_000 + "]" * 200_000).encode()


def with_header(bundle: Path, out: Path, edit) -> Path:
    """A copy of `bundle` whose bundle.json is `edit(header)`: a dict, or bytes written as they are."""

    def members(ms):
        for info, data in ms:
            if info.name == BUNDLE_JSON:
                new = edit(json.loads(data))
                data = new if isinstance(new, bytes) else json.dumps(new).encode()
                info.size = len(data)
            yield info, data

    return rewrite(bundle, out, members)


def with_record(header: dict, name: str, **fields) -> dict:
    """The header with record `name` of its entry changed (a field set to None is removed)."""
    shapes = header["entries"][header["digest"]]["shapes"]
    record = {**shapes.get(name, shapes["512x512"]), **fields}
    shapes[name] = {k: v for k, v in record.items() if v is not None}
    return header


BAD_HEADERS = {  # what: (edit the header, what the refusal must name)
    "a wrong type": (lambda h: with_record(h, "512x512", seconds="abc"), "record '512x512'.*field 'seconds'"),
    "a missing field": (lambda h: with_record(h, "512x512", tokens=None),
                        "record '512x512'.*field 'tokens' is missing"),
    "a hostile name": (lambda h: with_record(h, "../../../etc/x", resolution="<script>alert(1)</script>"),
                       "record '../../../etc/x'"),
    "a hostile resolution": (lambda h: with_record(h, "512x512", resolution="<script>alert(1)</script>"),
                             "record '512x512'.*field 'resolution'"),
    "200k levels deep": (lambda h: DEEP, "nests 200000 levels deep"),
    "deep inside a record": (lambda h: json.dumps(with_record(h, "512x512", date="@")).replace('"@"', DEEP.decode())
                             .encode(), "nests"),
    "a file entry without a size": (lambda h: {**h, "files": [{**h["files"][0], "size": "big"}, *h["files"][1:]]},
                                    "file 0 .*'size'"),
}


@pytest.mark.parametrize("what", BAD_HEADERS)
def test_a_bundle_json_outside_the_schema_is_refused_naming_record_and_field(what, bundle, target, tmp_path):
    edit, reason = BAD_HEADERS[what]
    bad = with_header(bundle, tmp_path / "bad.tar.gz", edit)
    before = snapshot(target.root)

    with pytest.raises(BundleError, match="nothing was changed") as error:
        import_bundle(target, KEY, bad)
    assert re.search(reason, str(error.value)), str(error.value)
    assert snapshot(target.root) == before
    assert "alert(1)" not in CacheManifest(target.manifest).entries().__repr__()


def test_a_newer_bundles_extra_fields_are_ignored(bundle, target, tmp_path):
    newer = with_header(bundle, tmp_path / "newer.tar.gz",
                        lambda h: {**with_record(h, "512x512", load_seconds=0.4), "signed_by": {"who": "ci"}})

    assert import_bundle(target, KEY, newer).added_shapes == ["512x512"]
    assert CacheManifest(target.manifest).shapes(KEY)["512x512"].tokens == 1024


def test_the_app_starts_cold_on_a_200k_deep_bundle_json_and_logs_why(bundle, tmp_path, monkeypatch, caplog):
    from neuron_ui.config.cache_paths import NEFF_CACHE_ENV

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "restored-after-the-test")
    monkeypatch.delenv(NEFF_CACHE_ENV, raising=False)
    nested = with_header(bundle, tmp_path / "nested.tar.gz", lambda h: DEEP)
    settings = parse_settings(["--model", "tiny", "--device", "cpu", "--resolutions", "256x256,512x512",
                                   "--cache-dir", str(tmp_path / "cache"), "--cache-bundle", str(nested)])

    status = build_engine(settings).status()

    assert not status.shape("512x512").on_disk
    assert "not using --cache-bundle" in caplog.text and "nests 200000 levels deep" in caplog.text
    assert "starting cold" in caplog.text and "Traceback" not in caplog.text


# -- only the bundle we trust, only what fits, nothing left behind --------------------------------------------


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_pinned_sha256_admits_that_bundle_and_refuses_any_other(bundle, target, tmp_path):
    pinned = sha256_of(bundle)
    other = with_header(bundle, tmp_path / "other.tar.gz", lambda h: {**h, "created": "2020-01-01T00:00:00+0000"})
    before = snapshot(target.root)

    with pytest.raises(BundleError, match=f"expected sha256 {pinned}, got {sha256_of(other)}.*nothing was changed"):
        import_bundle(target, KEY, other, sha256=pinned)
    assert snapshot(target.root) == before

    assert import_bundle(target, KEY, bundle, sha256=pinned.upper()).added_shapes == ["512x512"]


def test_the_pin_is_a_flag_and_an_env_var_checked_at_start_up():
    from neuron_ui.config.settings import build_parser, settings_from_args

    digest = "ab" * 32
    args = build_parser().parse_args(["--cache-bundle", "b.tar.gz", "--cache-bundle-sha256", digest.upper()])
    assert settings_from_args(args, environ={}).cache_bundle_sha256 == (digest,)
    env = {"NEURON_UI_CACHE_BUNDLE_SHA256": digest}
    assert settings_from_args(build_parser().parse_args([]), environ=env).cache_bundle_sha256 == (digest,)
    with pytest.raises(ValueError, match="64 hex digits"):
        settings_from_args(build_parser().parse_args(["--cache-bundle-sha256", "abc"]), environ={})


def test_the_app_starts_cold_on_a_bundle_that_is_not_the_pinned_one(bundle, tmp_path, monkeypatch, caplog):
    from neuron_ui.config.cache_paths import NEFF_CACHE_ENV

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "restored-after-the-test")
    monkeypatch.delenv(NEFF_CACHE_ENV, raising=False)
    monkeypatch.setenv("NEURON_UI_CACHE_BUNDLE_SHA256", "0" * 64)
    settings = parse_settings(["--model", "tiny", "--device", "cpu", "--resolutions", "256x256,512x512",
                                   "--cache-dir", str(tmp_path / "cache"), "--cache-bundle", str(bundle)])

    status = build_engine(settings).status()

    assert not status.shape("512x512").on_disk
    assert f"expected sha256 {'0' * 64}, got {sha256_of(bundle)}" in caplog.text and "starting cold" in caplog.text


def test_a_bundle_larger_than_the_free_space_is_refused_before_extracting(bundle, target, tmp_path):
    huge = with_header(bundle, tmp_path / "huge.tar.gz", lambda h: {
        **h, "files": [{**f, "size": 2**50} if f["path"].endswith(".so") else f for f in h["files"]]})
    before = snapshot(target.root)

    with pytest.raises(BundleError, match=r"holds 1048576\.0 GiB, more than .* can take: .* free.*nothing was changed"):
        import_bundle(target, KEY, huge)
    assert snapshot(target.root) == before


KILLED_IMPORT = """
import json, os, signal, sys
from pathlib import Path
from neuron_ui.cache import bundle_import
from neuron_ui.compile.key import CompileKey
from neuron_ui.contract.results import CacheEvent
from neuron_ui.config.cache_paths import configure_cache_env

cache = configure_cache_env(Path(sys.argv[1]), environ={})
looks = Path.exists

def killed(path, *args, **kwargs):  # once everything is staged: at the import's first look at a file in the cache
    if path.is_relative_to(cache.inductor):
        os.kill(os.getpid(), signal.SIGKILL)
    return looks(path, *args, **kwargs)

Path.exists = killed
bundle_import.import_bundle(cache, CompileKey(**json.loads(sys.argv[3])), Path(sys.argv[2]))
"""


def test_staging_left_by_a_killed_import_is_swept_at_the_next_start(bundle, target, tmp_path):
    before = snapshot(target.root)
    killed = subprocess.run([sys.executable, "-c", KILLED_IMPORT, str(target.root), str(bundle),
                             json.dumps(dataclasses.asdict(KEY))], cwd=REPO, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    (left,) = target.root.glob(".import-*")
    assert any(p.is_file() for p in left.rglob("*"))  # the whole bundle, staged
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as alive:
        try:
            live = target.root / f".import-{alive.pid}.{socket.gethostname()}.abc123"  # another process importing
            elsewhere = target.root / f".import-{os.getpid()}.another-host.abc123"  # another machine's, shared folder
            for folder in (live, elsewhere):
                folder.mkdir()

            configure_cache_env(target.root, environ={})  # what every start does: app, CLI, engine

            assert sorted(target.root.glob(".import-*")) == sorted([live, elsewhere])
        finally:
            alive.kill()
    configure_cache_env(target.root, environ={})
    assert sorted(target.root.glob(".import-*")) == [elsewhere]
    elsewhere.rmdir()
    assert snapshot(target.root) == before


# -- clear -----------------------------------------------------------------------------------------


def test_clear_one_resolution_then_one_key_keeps_the_artifacts(source):
    before = snapshot(source.inductor)

    result = clear_cache(source, KEY, ["512x512"])
    assert result.removed_shapes == [f"{KEY.digest}/512x512"]
    assert set(CacheManifest(source.manifest).shapes(KEY)) == {"256x256"}

    clear_cache(source, KEY)
    assert CacheManifest(source.manifest).shapes(KEY) == {}
    assert set(CacheManifest(source.manifest).shapes(OTHER_KEY)) == {"256x256"}
    assert snapshot(source.inductor) == before  # shared by every key: left alone

    with pytest.raises(ValueError, match="no record of 1024x1024"):
        clear_cache(source, OTHER_KEY, ["1024x1024"])
    with pytest.raises(ValueError, match="needs a compile key"):
        clear_cache(source, None, ["256x256"])


def test_full_clear_empties_the_folders_but_keeps_them(source):
    (source.root / ".import-stale").mkdir()  # left by an import that was killed
    result = clear_cache(source)

    assert len(result.removed_shapes) == 3 and result.removed_files == len(ARTIFACTS)
    assert list_cache(source).keys == []
    assert source.inductor.is_dir() and not any(source.inductor.iterdir())
    assert not (source.root / ".import-stale").exists()


def test_full_clear_leaves_a_neff_folder_outside_the_cache_alone(tmp_path):
    own = tmp_path / "users-own-neff"
    cache = configure_cache_env(tmp_path / "cache", environ={"TORCH_NEURONX_NEFF_CACHE_DIR": str(own)})
    (own / "MODULE_1").mkdir()
    (own / "MODULE_1" / "model.neff").write_bytes(b"neff")

    result = clear_cache(cache)
    assert result.skipped_folders == [own]
    assert (own / "MODULE_1" / "model.neff").exists()


# -- the CLI: python -m neuron_ui cache ... -------------------------------------------------------

CLI_FLAGS = ["--model", "tiny", "--device", "cpu"]


@pytest.fixture
def cache_cli(monkeypatch, capsys):
    """`python -m neuron_ui cache ...` called in process (neuron_ui.cli.main), answering as a process would: its exit
    code, stdout and stderr. Each call sets the cache variables as a new process would; they are restored after."""
    from neuron_ui import cli
    from neuron_ui.config.cache_paths import NEFF_CACHE_ENV

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "restored-after-the-test")

    def run(*args: str, cache_dir: Path) -> subprocess.CompletedProcess:
        monkeypatch.delenv(NEFF_CACHE_ENV, raising=False)  # unset, as in a new process: each call's own folder
        argv = ["cache", *args, *CLI_FLAGS, "--cache-dir", str(cache_dir)]
        code = cli.main(argv)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, out, err)

    return run


def cache_cli_process(*args: str, cache_dir: Path) -> subprocess.CompletedProcess:
    """The real command line, `python -m neuron_ui cache ...`, in a new process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "neuron_ui", "cache", *args, *CLI_FLAGS, "--cache-dir",
                           str(cache_dir)], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def test_cache_cli_ls_export_import_clear(source, tmp_path, cache_cli):
    listed = cache_cli("ls", cache_dir=source.root)
    assert listed.returncode == 0 and f"* key {KEY.digest}" in listed.stdout and "512x512" in listed.stdout

    out = cache_cli("export", "--out", str(tmp_path / "b.tar.gz"), "--resolutions", "512x512", cache_dir=source.root)
    assert out.returncode == 0, out.stderr
    assert "wrote" in out.stdout and "512x512" in out.stdout

    fresh = tmp_path / "fresh"
    imported = cache_cli("import", str(tmp_path / "b.tar.gz"), cache_dir=fresh)
    assert imported.returncode == 0 and "added 512x512" in imported.stdout
    assert set(CacheManifest(fresh / "manifest.json").entries()[KEY.digest]["shapes"]) == {"512x512"}

    refused = cache_cli("import", str(tmp_path / "b.tar.gz"), "--compile", "full", cache_dir=tmp_path / "other")
    assert refused.returncode == 2 and "mode: bundle regional, here full" in refused.stderr
    assert "Traceback" not in refused.stderr

    cleared = cache_cli("clear", "--resolutions", "512x512", cache_dir=fresh)
    assert cleared.returncode == 0 and "cleared 1 shape record" in cleared.stdout
    assert KEY.digest not in CacheManifest(fresh / "manifest.json").entries()
    everything = cache_cli("clear", cache_dir=source.root)
    assert everything.returncode == 0 and not any(source.inductor.iterdir())


def test_the_cache_command_line_refuses_a_bundle_that_is_not_the_pinned_one_with_exit_code_2(bundle, tmp_path):
    """End to end once, in a new process: `python -m neuron_ui` reaches the cache command and exits with its code."""
    pinned = cache_cli_process("import", str(bundle), "--cache-bundle-sha256", "0" * 64, cache_dir=tmp_path / "p")

    assert pinned.returncode == 2
    assert f"expected sha256 {'0' * 64}, got {sha256_of(bundle)}" in pinned.stderr
    assert "Traceback" not in pinned.stderr
    assert not CacheManifest(tmp_path / "p" / "manifest.json").entries()


def test_the_cache_commands_key_a_folder_without_importing_the_models_libraries(tmp_path):
    """`cache ls` (and import, export, clear: the same key) read flags, the device and versions, not the model:
    without diffusers and transformers the command takes about 1.6 cpu-s here instead of 6."""
    code = ("import sys; from neuron_ui.cli import main; "
            f"code = main(['cache', 'ls', '--model', 'tiny', '--device', 'cpu', '--cache-dir', {str(tmp_path)!r}]); "
            "print(code, sorted({'diffusers', 'transformers'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "0 []"


def test_app_imports_a_cache_bundle_before_serving_and_starts_cold_on_a_bad_one(bundle, tmp_path, monkeypatch, caplog):
    from neuron_ui.config.cache_paths import NEFF_CACHE_ENV

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "restored-after-the-test")
    monkeypatch.delenv(NEFF_CACHE_ENV, raising=False)
    flags = ["--model", "tiny", "--device", "cpu", "--resolutions", "256x256,512x512"]
    settings = parse_settings([*flags, "--cache-dir", str(tmp_path / "warm"), "--cache-bundle", str(bundle)])
    status = build_engine(settings).status()
    assert status.shape("512x512").on_disk and not status.shape("256x256").on_disk

    monkeypatch.delenv(NEFF_CACHE_ENV, raising=False)
    settings = parse_settings([*flags, "--compile", "full", "--cache-dir", str(tmp_path / "cold"),
                                   "--cache-bundle", str(bundle)])
    status = build_engine(settings).status()
    assert not status.shape("512x512").on_disk
    assert "not using --cache-bundle" in caplog.text and "mode: bundle regional, here full" in caplog.text
