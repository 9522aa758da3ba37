"""Cache admin: what is on disk per compile key (ls) and clearing it; and the files the cache's commands (ls, export,
import, publish, clear) share: walking a folder, hashing a file or a stream, removing a path."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, TYPE_CHECKING, BinaryIO

from neuron_ui.cache.manifest import CacheManifest, ShapeRecord
from neuron_ui.compile.key import NEURON_PACKAGES, CompileKey
from neuron_ui.config.cache_paths import STAGING_PREFIX, sweep_staging
from neuron_ui.config.resolutions import parse_resolution
from neuron_ui.config.runtime import Runtime, detect_launch

if TYPE_CHECKING:
    from neuron_ui.config.cache_paths import CachePaths
    from neuron_ui.config.settings import Settings

logger = logging.getLogger(__name__)

SKIPPED_DIRS = {"locks"}  # inductor's empty filelock files, recreated on demand
CHUNK = 2**20


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


def key_for_settings(settings: Settings) -> CompileKey:
    """This machine's compile key for `settings`, as the engine will compute it, without loading the model."""
    from neuron_ui.model.hub import choose_model

    runtime = Runtime.detect(settings.device, settings.dtype, settings.compile_backend)
    name = choose_model(settings.model, settings.hub_timeout).name
    launch = detect_launch()
    tp_degree = launch.world_size if launch else settings.tp or 1
    return CompileKey.current(name, settings.compile, runtime.backend, runtime.dtype, tp_degree)


def describe_key(key: CompileKey | dict) -> str:
    """A key's fields as name=value, for a listing or an error (a key from the manifest may lack newer fields)."""
    k = key.as_dict() if isinstance(key, CompileKey) else key
    return " ".join(f"{f.name}={k.get(f.name)}" for f in fields(CompileKey)
                    if f.name in k or f.name not in NEURON_PACKAGES)  # no Neuron release: nothing to say


def folder_usage(folder: Path) -> FolderUsage:
    """How many files the folder holds (lock files and links aside) and what they weigh."""
    sizes = [path.stat().st_size for path in walk_files(folder)]
    return FolderUsage(folder, len(sizes), sum(sizes))


def list_cache(cache: CachePaths) -> CacheListing:
    """What the cache folder holds, for `cache ls`."""
    entries = CacheManifest(cache.manifest).entries()
    keys = []
    for digest, entry in sorted(entries.items(), key=lambda item: describe_key(item[1].get("key", {}))):
        shapes = [ShapeRecord(**rec) for rec in entry.get("shapes", {}).values()]
        keys.append(KeyListing(digest, entry.get("key", {}), sorted(shapes, key=lambda s: (s.tokens, s.resolution))))
    return CacheListing(cache.root, keys, {name: folder_usage(path) for name, path in cache_folders(cache).items()})


def cache_folders(cache: CachePaths) -> dict[str, Path]:
    """What `ls` weighs and a full clear empties: the compilers' folders, and the bundles fetched from a URL or the
    Hub, kept by digest so a restart downloads nothing (cache/warm_boot.py)."""
    return {"inductor": cache.inductor, "neff": cache.neff, "aot": cache.aot, "bundles": cache.root / "bundles"}


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
    """Bytes as a person reads them: B below 1 KiB, then KiB, MiB, GiB (the largest unit, however many)."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def clear_cache(cache: CachePaths, key: CompileKey | None = None, resolutions: list[str] | None = None) -> ClearResult:
    """Forget shapes; with no key, forget everything and empty the artifact folders and the fetched bundles too.

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
        if missing := [r for r in wanted if r not in shapes]:
            raise ValueError(f"no record of {', '.join(missing)} for key {key.digest}; "
                             f"recorded: {', '.join(sorted(shapes)) or 'none'}")
    result = ClearResult(removed_shapes=manifest.forget(key.digest if key else None, wanted))
    if key is None:
        for folder in cache_folders(cache).values():
            if not folder.resolve().is_relative_to(cache.root.resolve()):
                logger.warning("not emptying %s: it is outside the cache folder %s", folder, cache.root)
                result.skipped_folders.append(folder)
                continue
            usage = folder_usage(folder)
            result.removed_files += usage.files
            result.freed_bytes += usage.bytes
            for child in folder.iterdir() if folder.is_dir() else ():
                remove_path(child)
        sweep_staging(cache.root)  # left by imports that were killed
    logger.info("cleared %d shapes, %d files (%s)", len(result.removed_shapes), result.removed_files,
                human_bytes(result.freed_bytes))
    return result


def describe_holdings(cache: CachePaths) -> str:
    """What the manifest records, key by key: for an error that says what the cache does hold."""
    entries = CacheManifest(cache.manifest).entries()
    if not entries:
        return "its manifest is empty"
    return "it holds " + "; ".join(f"{describe_key(e.get('key', {}))}: {', '.join(sorted(e.get('shapes', {})))}"
                                   for e in entries.values())


def walk_files(folder: Path) -> Iterator[Path]:
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


def hash_stream(handle: BinaryIO) -> tuple[int, str]:
    """The size and sha256 of what is left in handle, read in chunks."""
    digest, size = hashlib.sha256(), 0
    while chunk := handle.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def hash_file(path: Path) -> tuple[int, str]:
    """The file's size and sha256, read in chunks."""
    with open(path, "rb") as handle:
        return hash_stream(handle)


class HashingReader:
    """Hash what tarfile reads, so the bytes archived are the bytes listed."""

    def __init__(self, handle: IO[bytes]):
        self.handle, self.digest = handle, hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        self.digest.update(data)
        return data

    def hexdigest(self) -> str:
        return self.digest.hexdigest()


def remove_path(path: Path | None) -> None:
    """Remove a file, a link or a whole folder; nothing when it is not there."""
    if path is None or not (path.exists() or path.is_symlink()):
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
