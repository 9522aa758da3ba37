"""Export a compile-cache bundle: one instance compiles, the fleet imports."""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from neuron_ui.cache.admin import describe_holdings, describe_key, human_bytes
from neuron_ui.cache.bundle_format import (
    ARTIFACTS,
    BUNDLE_FORMAT,
    BUNDLE_JSON,
    BundleFile,
    BundleInfo,
    artifact_folders,
    bundle_name,
    this_machine,
)
from neuron_ui.cache.files import HashingReader, Readable, hash_file, walk_files
from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.config.resolutions import parse_resolution

if TYPE_CHECKING:
    from neuron_ui.compile.key import CompileKey
    from neuron_ui.config.cache_paths import CachePaths

logger = logging.getLogger(__name__)


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
                         f"{describe_key(key)} ({describe_holdings(cache)}). Compile them first (warm up the sizes) "
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
    sections = artifact_folders(cache, key)
    sources = {f"{name}/{path.relative_to(folder).as_posix()}": path
               for name, folder in sections.items() for path in walk_files(folder)}
    if not sources:
        raise ValueError(f"the manifest records {', '.join(chosen)} but {', '.join(map(str, sections.values()))} "
                         "holds no artifacts (cleared?); compile again before exporting")
    files = [BundleFile(name, *hash_file(path), mode=path.stat().st_mode & 0o755) for name, path in
             sorted(sources.items())]
    info = BundleInfo(
        path=out,
        key=asdict(key),
        resolutions=chosen,
        files=files,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        built_on=this_machine(),
    )
    header = {"format": BUNDLE_FORMAT, "created": info.created, "key": info.key, "digest": key.digest,
              "resolutions": chosen, "built_on": info.built_on, "files": [asdict(f) for f in files],
              "entries": {key.digest: {"key": asdict(key), "shapes": {r: recorded[r] for r in chosen}}}}
    _write_tar(out, header, files, sources)
    logger.info("exported %s: %s, %d files, %s", out, ", ".join(chosen), len(files), human_bytes(info.bytes))
    return info


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
                    reader = HashingReader(handle)
                    _add(tar, f.path, f.size, f.mode, reader)
                if reader.hexdigest() != f.sha256:
                    raise RuntimeError(f"{sources[f.path]} changed during export (is a compile running?); try again")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the bundle from the service user that imports it
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _add(tar: tarfile.TarFile, name: str, size: int, mode: int, fileobj: Readable) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, int(time.time())
    tar.addfile(info, fileobj)
