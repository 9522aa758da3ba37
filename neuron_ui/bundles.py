"""Compile-cache bundles: one instance compiles, the fleet imports, and every instance starts warm.

A bundle is a `.tar.gz` whose first member is `bundle.json` (format, compile key, the manifest entries
for the shapes it carries, and every file with its size and sha256), followed by the compiled
artifacts: `inductor/...` (TORCHINDUCTOR_CACHE_DIR) and, for the neuron backend, `neff/...`
(TORCH_NEURONX_NEFF_CACHE_DIR); for `--compile aot`, only that key's AOTInductor packages, `aot/<digest>/...`.
We ship the cache folders themselves rather than `torch.compiler.save_cache_artifacts()`: on CPU the
artifacts lack the compiled C++ kernels, so g++ runs again (measured here: 35-50% of the cold time saved, against 80-85% for a copied folder).

Importing never half-applies: everything is extracted to a staging folder inside the cache root and
verified first; files then move into place, and the manifest is merged last, so an interrupted import
leaves shapes cold, never falsely ready. The CLI (`python -m neuron_ui cache ls|export|import|clear`)
calls the functions here; nothing here imports the engine or loads a model.
"""

from __future__ import annotations

import errno
import fcntl
import gzip
import hashlib
import io
import json
import logging
import os
import platform
import re
import shutil
import tarfile
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from .compilation import DATE_PATTERN, CacheManifest, CompileKey, ShapeRecord, load_json, parse_entries
from .device import (MIN_FREE_BYTES, STAGING_PREFIX, CachePaths, Runtime, detect_launch, free_bytes, staging_prefix,
                     sweep_staging)
from .resolutions import parse_resolution
from .settings import Settings, parse_sha256

logger = logging.getLogger(__name__)

BUNDLE_FORMAT = 1
BUNDLE_JSON = "bundle.json"
MAX_BUNDLE_JSON = 16 * 2**20
# Which cache folders hold a backend's compiled artifacts; other backends (eager, aot_eager) keep none.
ARTIFACTS = {"inductor": ("inductor",), "neuron": ("neff", "inductor")}
AOT = "aot"  # --compile aot keeps its AOTInductor packages in aot/<key digest>/ and nothing else
SECTIONS = {name for names in ARTIFACTS.values() for name in names} | {AOT}
SKIPPED_DIRS = {"locks"}  # inductor's empty filelock files, recreated on demand
CHUNK = 2**20
_SHA256 = re.compile(r"[0-9a-f]{64}")


class BundleError(ValueError):
    """A bundle this cache must not take; the message says why, and that nothing was changed."""


@dataclass(frozen=True)
class BundleFile:
    path: str  # "inductor/ab/xyz.so", always posix
    size: int
    sha256: str
    mode: int = 0o644


@dataclass
class BundleInfo:
    """What a bundle holds (export, inspect) or what an import did with it."""

    path: Path
    key: dict
    resolutions: list[str]
    files: list[BundleFile]
    created: str = ""
    built_on: dict = field(default_factory=dict)
    added_shapes: list[str] = field(default_factory=list)  # import: new in this cache's manifest
    kept_shapes: list[str] = field(default_factory=list)  # import: this cache already had a record
    kept_files: int = 0  # import: already present here, left as they were

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass
class FolderUsage:
    path: Path
    files: int
    bytes: int


@dataclass
class KeyListing:
    digest: str
    key: dict
    shapes: list[ShapeRecord]


@dataclass
class CacheListing:
    """The manifest grouped by compile key, and what the artifact folders weigh (they are shared by all keys)."""

    root: Path
    keys: list[KeyListing]
    folders: dict[str, FolderUsage]


@dataclass
class ClearResult:
    removed_shapes: list[str]  # "digest/resolution"
    removed_files: int = 0
    freed_bytes: int = 0
    skipped_folders: list[Path] = field(default_factory=list)  # outside the cache root: the user's own


# -- the manifest, read and written whole ----------------------------------------------------------


def key_for_settings(settings: Settings, model_name: str | None = None) -> CompileKey:
    """This machine's compile key for `settings`, as the engine will compute it, without loading the model.

    Pass `model_name` (a `choose_model(...).name` already made) to skip deciding again what `--model auto` means.
    """
    from .loading import choose_model

    runtime = Runtime.detect(settings.device, settings.dtype, settings.compile_backend)
    name = model_name or choose_model(settings.model, settings.hub_timeout).name
    launch = detect_launch()
    tp_degree = launch.world_size if launch else settings.tp or 1
    return CompileKey.current(name, settings.compile, runtime.backend, runtime.dtype, tp_degree)


def describe_key(key: CompileKey | dict) -> str:
    k = asdict(key) if isinstance(key, CompileKey) else key
    return " ".join(f"{name}={k.get(name)}" for name in (f.name for f in fields(CompileKey)))


# -- ls ------------------------------------------------------------------------------------------


def folder_usage(folder: Path) -> FolderUsage:
    files = size = 0
    for path in _walk_files(folder):
        files += 1
        size += path.stat().st_size
    return FolderUsage(folder, files, size)


def list_cache(cache: CachePaths) -> CacheListing:
    """What the cache folder holds, for `cache ls`."""
    entries = CacheManifest(cache.manifest).entries()
    keys = []
    for digest, entry in sorted(entries.items(), key=lambda item: describe_key(item[1].get("key", {}))):
        shapes = [ShapeRecord(**rec) for rec in entry.get("shapes", {}).values()]
        keys.append(KeyListing(digest, entry.get("key", {}), sorted(shapes, key=lambda s: (s.tokens, s.resolution))))
    return CacheListing(cache.root, keys, {"inductor": folder_usage(cache.inductor), "neff": folder_usage(cache.neff),
                                           "aot": folder_usage(cache.aot)})


def format_listing(listing: CacheListing, current: CompileKey | None = None) -> str:
    """A plain-text table; `current` (this machine's key) is marked with '*'."""
    lines = [f"cache {listing.root}"]
    for name, usage in listing.folders.items():
        lines.append(f"  {name:<9}{human_bytes(usage.bytes):>10} in {usage.files} files  {usage.path}")
    if not listing.keys:
        lines.append("no compiled shapes recorded")
    for entry in listing.keys:
        mark = "*" if current is not None and entry.digest == current.digest else " "
        lines.append(f"{mark} key {entry.digest}  {describe_key(entry.key)}")
        lines.append(f"    {'resolution':<11}{'tokens':>7}{'seconds':>9}{'cold s':>9}  {'event':<10}date")
        for s in entry.shapes:
            cold = f"{s.cold_seconds:.1f}" if s.cold_seconds is not None else "-"
            lines.append(f"    {s.resolution:<11}{s.tokens:>7}{s.seconds:>9.1f}{cold:>9}  {s.event:<10}{s.date}")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"


# -- export ----------------------------------------------------------------------------------------


def bundle_name(key: CompileKey) -> str:
    return f"neuron-ui-{key.digest}.tar.gz"


def export_bundle(cache: CachePaths, key: CompileKey, out: Path, resolutions: list[str] | None = None) -> BundleInfo:
    """Write the compiled shapes of `key` and the artifacts behind them to a `.tar.gz` at `out` (or in it, if a folder).

    The inductor folder cannot be split by shape or even by key (its entries are content hashes with no
    record of which graph or key made them), so it is exported whole: the bundle may carry more than the
    shapes it names, never less. The same holds for the NEFF folder.
    """
    entry = CacheManifest(cache.manifest).entries().get(key.digest, {})
    recorded = entry.get("shapes", {})
    if not recorded:
        raise ValueError(f"nothing to export: the cache at {cache.root} has no compiled shapes for "
                         f"{describe_key(key)} ({_holds(cache)}). Compile them first (warm up the sizes) "
                         "with the same --model, --compile, --dtype and backend.")
    chosen = sorted(recorded) if resolutions is None else [str(parse_resolution(r)) for r in resolutions]
    missing = [r for r in chosen if r not in recorded]
    if missing:
        raise ValueError(f"nothing compiled at {', '.join(missing)} for key {key.digest}; "
                         f"compiled: {', '.join(sorted(recorded))}")
    if key.backend not in ARTIFACTS:
        raise ValueError(f"backend {key.backend!r} keeps no compiled artifacts on disk: nothing to export "
                         f"(bundles carry {', '.join(ARTIFACTS)} caches)")
    out = Path(out) / bundle_name(key) if Path(out).is_dir() else Path(out)
    sections = _sections(cache, key)
    sources = {f"{name}/{path.relative_to(folder).as_posix()}": path
               for name, folder in sections.items() for path in _walk_files(folder)}
    if not sources:
        raise ValueError(f"the manifest records {', '.join(chosen)} but {', '.join(map(str, sections.values()))} "
                         "holds no artifacts (cleared?); compile again before exporting")
    files = [BundleFile(name, *_hash_file(path), mode=path.stat().st_mode & 0o755) for name, path in
             sorted(sources.items())]
    info = BundleInfo(
        path=out,
        key=asdict(key),
        resolutions=chosen,
        files=files,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        built_on={"python": platform.python_version(), "machine": platform.machine(), "system": platform.system()},
    )
    manifest_entries = {key.digest: {"key": asdict(key), "shapes": {r: recorded[r] for r in chosen}}}
    header = {
        "format": BUNDLE_FORMAT,
        "created": info.created,
        "key": info.key,
        "digest": key.digest,
        "resolutions": chosen,
        "entries": manifest_entries,
        "built_on": info.built_on,
        "files": [asdict(f) for f in files],
    }
    _write_tar(out, header, files, sources)
    logger.info("exported %s: %s, %d files, %s", out, ", ".join(chosen), len(files), human_bytes(info.bytes))
    return info


def _sections(cache: CachePaths, key: CompileKey) -> dict[str, Path]:
    """The folders holding this key's artifacts: its own AOT packages, or the compiler caches of its backend."""
    if key.mode == AOT:
        return {f"{AOT}/{key.digest}": cache.aot / key.digest}
    return {name: getattr(cache, name) for name in ARTIFACTS[key.backend]}


def _write_tar(out: Path, header: dict, files: list[BundleFile], sources: dict[str, Path]) -> None:
    """Write next to `out` and rename, so a reader never sees half a bundle at `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz", compresslevel=6) as tar:
            data = json.dumps(header, indent=1, sort_keys=True).encode()
            _add(tar, BUNDLE_JSON, len(data), 0o644, io.BytesIO(data))
            for f in files:
                with open(sources[f.path], "rb") as handle:
                    reader = _HashingReader(handle)
                    _add(tar, f.path, f.size, f.mode, reader)
                if reader.hexdigest() != f.sha256:
                    raise RuntimeError(f"{sources[f.path]} changed during export (is a compile running?); try again")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the bundle from the service user that imports it
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _add(tar: tarfile.TarFile, name: str, size: int, mode: int, fileobj: BinaryIO) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, int(time.time())
    tar.addfile(info, fileobj)


# -- import ----------------------------------------------------------------------------------------


def import_at_start(settings: Settings, cache: CachePaths) -> None:
    """--cache-bundle at start-up: a refused bundle (another compile key, damaged, missing) is logged and the app
    starts cold. Replicas sharing a cache folder import one at a time (a lock in the folder); the later ones find
    everything there already."""
    try:
        (cache.root / "locks").mkdir(parents=True, exist_ok=True)
        with open(cache.root / "locks" / "bundle-import.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or by the kernel if this process dies
            info = import_bundle(cache, key_for_settings(settings), settings.cache_bundle, settings.cache_bundle_sha256)
    except (ValueError, OSError) as error:
        logger.warning("not using --cache-bundle: %s; starting cold", error)
        return
    except Exception:  # a bug of ours must not keep the app from starting either
        logger.exception("not using --cache-bundle: importing it failed unexpectedly; starting cold")
        return
    logger.info("imported %s: %s", settings.cache_bundle, ", ".join(info.added_shapes) or "nothing new")


def inspect_bundle(bundle: Path) -> BundleInfo:
    """Read only bundle.json: what a bundle claims to hold, without verifying or extracting anything."""
    try:
        with gzip.open(bundle, "rb") as gz, tarfile.open(fileobj=gz, mode="r|") as tar:
            return _info(Path(bundle), _read_header(tar, Path(bundle)))
    except (tarfile.TarError, EOFError, zlib.error, OSError) as error:
        raise BundleError(f"{bundle} is not a readable bundle ({_why(error)})") from error


def import_bundle(cache: CachePaths, key: CompileKey, bundle: Path, sha256: str | None = None) -> BundleInfo:
    """Verify a bundle against this machine's compile key and its own checksums, then add it to the cache.

    Refused (BundleError, cache untouched) on a sha256 other than the pinned one (`sha256`, the digest of
    the whole bundle file), a different compile key, a bundle.json outside the schema, more declared bytes
    than the cache folder has free, a corrupt or truncated archive, a checksum mismatch, or any member that
    is not a plain file at a relative path under inductor/ or neff/. Files already in the cache are kept:
    their names are content hashes, so they hold the same thing.
    """
    bundle = Path(bundle)
    staging: Path | None = None
    header: dict | None = None
    try:
        with open(bundle, "rb") as raw:
            if sha256 is not None:  # before reading a byte of it as a bundle: it may not be the one we trust
                _check_sha256(_hash_stream(raw), sha256, bundle)
                raw.seek(0)
            reader = _HashingReader(raw)
            # gzip rather than tarfile's own "r|gz": only GzipFile checks the CRC and length at the end.
            with gzip.GzipFile(fileobj=reader, mode="rb") as gz, tarfile.open(fileobj=gz, mode="r|") as tar:
                header = _read_header(tar, bundle)
                _check_key(header, key, bundle)
                info = _info(bundle, header)
                _check_space(cache, info)
                staging = Path(tempfile.mkdtemp(dir=cache.root, prefix=staging_prefix()))
                _extract_verified(tar, staging, {f.path: f for f in info.files}, bundle)
                while gz.read(CHUNK):  # to the very end, so a bundle cut short is refused even in its padding
                    pass
            while reader.read(CHUNK):
                pass
        if sha256 is not None:  # what was extracted is what was pinned, even if the file changed meanwhile
            _check_sha256(reader.hexdigest(), sha256, bundle)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as error:
        _remove(staging)
        raise BundleError(f"{bundle} is corrupt or truncated ({_why(error)}); nothing was changed. "
                          "Copy it again or export a new one.") from error
    except OSError as error:
        _remove(staging)
        if header is None:  # could not open or read the bundle file itself
            raise BundleError(f"{bundle} is not a readable bundle ({_why(error)}); nothing was changed") from error
        raise
    except BaseException:
        _remove(staging)
        raise
    try:
        for f in info.files:
            section, _, rest = f.path.partition("/")
            if _place(staging / f.path, getattr(cache, section) / rest):
                info.kept_files += 1
    finally:
        _remove(staging)
    _merge_entries(cache, key, header["entries"][key.digest]["shapes"], info)
    logger.info("imported %s: %d files (%d already here), shapes added %s, kept %s", bundle, len(info.files),
                info.kept_files, info.added_shapes or "none", info.kept_shapes or "none")
    return info


def _check_sha256(got: str, expected: str, bundle: Path) -> None:
    if got != parse_sha256(expected):
        raise BundleError(f"{bundle} is not the pinned bundle: expected sha256 {parse_sha256(expected)}, got {got}; "
                          "nothing was changed. Import only bundles you trust, and pin the digest of the one you "
                          "exported (--cache-bundle-sha256).")


def _check_space(cache: CachePaths, info: BundleInfo) -> None:
    """Refuse before extracting when the declared files would fill the disk (sizes are verified on extraction)."""
    free = free_bytes(cache.root)
    if info.bytes > free - MIN_FREE_BYTES:
        raise BundleError(f"{info.path} holds {human_bytes(info.bytes)}, more than {cache.root} can take: "
                          f"{human_bytes(free)} free, {human_bytes(MIN_FREE_BYTES)} of it kept spare; "
                          "nothing was changed. Free some space, or import fewer shapes.")


def _read_header(tar: tarfile.TarFile, bundle: Path) -> dict:
    """bundle.json, checked against the schema before anything trusts it."""
    member = tar.next()
    if member is None or member.name != BUNDLE_JSON or not member.isreg() or member.size > MAX_BUNDLE_JSON:
        raise BundleError(f"{bundle} is not a neuron-ui bundle: it does not start with {BUNDLE_JSON}; "
                          "nothing was changed")
    try:
        return _parse_header(load_json(tar.extractfile(member).read(), BUNDLE_JSON, MAX_BUNDLE_JSON), bundle)
    except ValueError as error:
        if isinstance(error, BundleError):
            raise
        raise BundleError(f"{bundle} has a malformed {BUNDLE_JSON} ({_why(error)}); nothing was changed") from error


def _parse_header(header: object, bundle: Path) -> dict:
    """The header with only the fields we read, each checked; a bad shape record is named with its field."""
    if not isinstance(header, dict):
        raise ValueError("not a mapping")
    if header.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{bundle} has bundle format {str(header.get('format'))[:20]!r}; this neuron-ui reads "
                          f"format {BUNDLE_FORMAT}; nothing was changed. Export it again with this version.")
    entries, problems = parse_entries(header.get("entries"))
    if problems:
        raise BundleError(f"{bundle} has a bad {problems[0]}; nothing was changed")
    digest = header.get("digest")
    if not isinstance(digest, str) or digest not in entries or len(entries) != 1:
        raise ValueError("'entries' must hold exactly the entry of its 'digest'")
    if header.get("key") != entries[digest]["key"]:
        raise ValueError("'key' is not the key of its entry")
    shapes = entries[digest]["shapes"]
    resolutions = header.get("resolutions")
    if not isinstance(resolutions, list) or sorted(map(str, resolutions)) != sorted(shapes):
        raise ValueError("'resolutions' must list the shapes of its entry")
    files = _parse_files(header.get("files"), bundle)
    created, built_on = header.get("created", ""), header.get("built_on", {})
    if not isinstance(created, str) or not DATE_PATTERN.fullmatch(created):
        raise ValueError("'created' is not a date")
    if not isinstance(built_on, dict) or not all(isinstance(v, str) and len(v) <= 100 for v in built_on.values()):
        raise ValueError("'built_on' must map names to short strings")
    return {"format": BUNDLE_FORMAT, "key": entries[digest]["key"], "digest": digest, "entries": entries,
            "resolutions": sorted(shapes), "files": files, "created": created, "built_on": built_on}


def _parse_files(files: object, bundle: Path) -> list[dict]:
    """The file list, each entry with a safe path (listed once), a size, a sha256 and a mode."""
    if not isinstance(files, list):
        raise ValueError("'files' must be a list")
    checked, seen = [], set()
    for n, f in enumerate(files):
        where = f"file {n} ({str(f.get('path'))[:60]!r})" if isinstance(f, dict) else f"file {n}"
        if (not isinstance(f, dict) or not isinstance(f.get("path"), str)
                or not isinstance(f.get("size"), int) or isinstance(f.get("size"), bool) or f["size"] < 0
                or not isinstance(f.get("sha256"), str) or not _SHA256.fullmatch(f["sha256"])
                or not isinstance(f.get("mode", 0o644), int) or not 0 <= f.get("mode", 0o644) <= 0o7777):
            raise ValueError(f"{where} needs a 'path', a 'size' in bytes, a 'sha256' and a numeric 'mode'")
        path = "/".join(_safe_parts(f["path"], bundle))
        if path in seen:
            raise ValueError(f"{where} is listed twice")
        seen.add(path)
        checked.append({"path": path, "size": f["size"], "sha256": f["sha256"], "mode": f.get("mode", 0o644)})
    return checked


def _info(bundle: Path, header: dict) -> BundleInfo:
    return BundleInfo(path=bundle, key=header["key"], resolutions=list(header["resolutions"]),
                      files=[BundleFile(**f) for f in header["files"]], created=header.get("created", ""),
                      built_on=header.get("built_on", {}))


def _check_key(header: dict, key: CompileKey, bundle: Path) -> None:
    """Name every field that differs; a near miss is still a miss (the graphs would not match)."""
    theirs, ours = header.get("key", {}), asdict(key)
    diffs = [f"{name}: bundle {theirs.get(name, '(missing)')}, here {ours.get(name, '(missing)')}"
             for name in sorted(set(theirs) | set(ours)) if theirs.get(name) != ours.get(name)]
    if diffs:
        raise BundleError(f"{bundle} was compiled under a different compile key; differs in {'; '.join(diffs)}. "
                          "Nothing was changed. Export a bundle from an instance with the same settings and "
                          "versions, or let this one compile.")
    if header.get("digest") != key.digest:
        raise BundleError(f"{bundle}: its digest {header.get('digest')} does not match its key; nothing was changed")
    built_on = header.get("built_on", {})
    here = {"python": platform.python_version(), "machine": platform.machine(), "system": platform.system()}
    other = {k: v for k, v in built_on.items() if here.get(k) not in (None, v)}
    if other:  # the compile key covers what changes a graph; these only risk cache misses
        logger.warning("%s was built on %s, this machine is %s: expect cache misses", bundle, other, here)


def _extract_verified(tar: tarfile.TarFile, staging: Path, expected: dict[str, BundleFile], bundle: Path) -> None:
    """Stream every member into `staging`, checking type, path, size and sha256; refuse anything else."""
    seen: set[str] = set()
    while (member := tar.next()) is not None:  # not `for member in tar`: that yields bundle.json again
        if member.isdir():
            _safe_parts(member.name, bundle, is_file=False)
            continue
        if not member.isreg():
            raise BundleError(f"{bundle} holds {member.name!r}, which is not a plain file (a link or device); "
                              "refusing it, nothing was changed")
        parts = _safe_parts(member.name, bundle)
        name = "/".join(parts)
        want = expected.get(name)
        if want is None or name in seen:
            raise BundleError(f"{bundle} holds {member.name!r}, which its {BUNDLE_JSON} does not list "
                              "(or lists once but holds twice); nothing was changed")
        if member.size != want.size:  # before writing a byte: a forged size must not fill the disk
            raise BundleError(f"{bundle}: {name} is {member.size} bytes, its {BUNDLE_JSON} says {want.size} "
                              "(corrupt bundle); nothing was changed")
        seen.add(name)
        target = staging.joinpath(*parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, size = hashlib.sha256(), 0
        with tar.extractfile(member) as source, open(target, "xb") as sink:
            while chunk := source.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
                sink.write(chunk)
        if size != want.size or digest.hexdigest() != want.sha256:
            raise BundleError(f"{bundle}: {name} does not match its checksum (corrupt bundle); nothing was changed")
        os.chmod(target, (want.mode & 0o755) | 0o600)
    absent = sorted(set(expected) - seen)
    if absent:
        raise BundleError(f"{bundle} lacks {len(absent)} listed files (truncated?), e.g. {absent[0]}; "
                          "nothing was changed")


def _safe_parts(name: str, bundle: Path, is_file: bool = True) -> tuple[str, ...]:
    """The path's parts when it is relative, plain and under a known section; else refuse the bundle."""
    path = PurePosixPath(name)
    parts = tuple(p for p in path.parts if p != ".")
    if (path.is_absolute() or "\\" in name or not parts or ".." in parts or parts[0] not in SECTIONS
            or (is_file and len(parts) < 2)):
        raise BundleError(f"{bundle} holds an unsafe or unexpected path {name!r}; refusing it, nothing was changed")
    return parts


def _place(source: Path, dest: Path) -> bool:
    """Move one verified file into the cache; True when an identical-named file was already there (kept)."""
    if dest.exists() or dest.is_symlink():
        return True
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(source, dest)
    except OSError as error:
        if error.errno != errno.EXDEV:  # NEFF folder on another filesystem: copy, then rename there
            raise
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=STAGING_PREFIX)
        os.close(fd)
        try:
            shutil.copy2(source, tmp)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return False


def _merge_entries(cache: CachePaths, key: CompileKey, shapes: dict, info: BundleInfo) -> None:
    """Add the bundle's shape records; this cache's own records win, as they were measured here."""
    added, kept = CacheManifest(cache.manifest).merge(key, shapes)
    info.added_shapes.extend(added)
    info.kept_shapes.extend(kept)


# -- clear -----------------------------------------------------------------------------------------


def clear_cache(cache: CachePaths, key: CompileKey | None = None, resolutions: list[str] | None = None) -> ClearResult:
    """Forget shapes; with no key, forget everything and empty the artifact folders too.

    With a key, only manifest records go: the artifacts are shared by every key and cannot be told apart,
    so those shapes become cold (the next compile may still hit what is left on disk). Folders outside the
    cache root (a user's own TORCH_NEURONX_NEFF_CACHE_DIR) are never emptied. The manifest is written
    first, so a clear cut short never leaves shapes recorded whose artifacts are gone.
    """
    if key is None and resolutions:
        raise ValueError("clearing some resolutions needs a compile key (which model, mode, dtype)")
    manifest = CacheManifest(cache.manifest)
    wanted = None
    if key is not None and resolutions is not None:
        shapes = manifest.entries().get(key.digest, {}).get("shapes", {})
        wanted = [str(parse_resolution(r)) for r in resolutions]
        missing = [r for r in wanted if r not in shapes]
        if missing:
            raise ValueError(f"no record of {', '.join(missing)} for key {key.digest}; "
                             f"recorded: {', '.join(sorted(shapes)) or 'none'}")
    result = ClearResult(removed_shapes=manifest.forget(key.digest if key else None, wanted))
    if key is None:
        for folder in (cache.inductor, cache.neff, cache.aot):
            if not folder.resolve().is_relative_to(cache.root.resolve()):
                logger.warning("not emptying %s: it is outside the cache folder %s", folder, cache.root)
                result.skipped_folders.append(folder)
                continue
            usage = folder_usage(folder)
            result.removed_files += usage.files
            result.freed_bytes += usage.bytes
            if folder.is_dir():
                _empty(folder)
        sweep_staging(cache.root)  # left by imports that were killed
    logger.info("cleared %d shapes, %d files (%s)", len(result.removed_shapes), result.removed_files,
                human_bytes(result.freed_bytes))
    return result


# -- helpers ---------------------------------------------------------------------------------------


def _walk_files(folder: Path):
    """Regular files under folder, sorted, skipping lock files and links (a bundle never carries links)."""
    if not folder.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith(STAGING_PREFIX))
        for name in sorted(filenames):
            path = Path(dirpath, name)
            if path.is_symlink() or not path.is_file():
                logger.warning("skipping %s: not a plain file", path)
                continue
            yield path


def _hash_file(path: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _hash_stream(handle: BinaryIO) -> str:
    digest = hashlib.sha256()
    while chunk := handle.read(CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


class _HashingReader:
    """Hash what tarfile reads, so the bytes archived are the bytes listed."""

    def __init__(self, handle: BinaryIO):
        self.handle, self.digest = handle, hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        self.digest.update(data)
        return data

    def hexdigest(self) -> str:
        return self.digest.hexdigest()


def _holds(cache: CachePaths) -> str:
    entries = CacheManifest(cache.manifest).entries()
    if not entries:
        return "its manifest is empty"
    return "it holds " + "; ".join(f"{describe_key(e.get('key', {}))}: {', '.join(sorted(e.get('shapes', {})))}"
                                   for e in entries.values())


def _empty(folder: Path) -> None:
    for child in folder.iterdir():
        _remove(child)


def _remove(path: Path | None) -> None:
    if path is None or not (path.exists() or path.is_symlink()):
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".strip()[:200]
