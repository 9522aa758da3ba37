"""Export a compile-cache bundle, to a file (`cache export`) or to the Hub (`cache publish`, which also says what a
new Space sets to start warm from it): one instance compiles, the fleet imports."""

from __future__ import annotations

import io
import json
import logging
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuron_ui.cache.admin import (
    HashingReader,
    describe_holdings,
    describe_key,
    hash_file,
    human_bytes,
    walk_files,
)
from neuron_ui.cache.bundle_format import (
    ARTIFACTS,
    BUNDLE_JSON,
    BundleFile,
    BundleInfo,
    artifact_folders,
    this_machine,
)
from neuron_ui.cache.fetch import parse_bundle_source
from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.config.cache_paths import replaced_whole, staging_folder
from neuron_ui.config.resolutions import parse_resolution
from neuron_ui.contract.errors import first_line

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
    out = Path(out) / f"neuron-ui-{key.digest}.tar.gz" if Path(out).is_dir() else Path(out)
    sections = artifact_folders(cache, key)
    sources = {f"{name}/{path.relative_to(folder).as_posix()}": path
               for name, folder in sections.items() for path in walk_files(folder)}
    if not sources:
        raise ValueError(f"the manifest records {', '.join(chosen)} but {', '.join(map(str, sections.values()))} "
                         "holds no artifacts (cleared?); compile again before exporting")
    files = [BundleFile(name, *hash_file(path), mode=path.stat().st_mode & 0o755) for name, path in
             sorted(sources.items())]
    info = BundleInfo(out, key.as_dict(), chosen, files, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      built_on=this_machine(), shapes={r: recorded[r] for r in chosen})
    _write_tar(info, sources)
    logger.info("exported %s: %s, %d files, %s", out, ", ".join(chosen), len(files), human_bytes(info.bytes))
    return info


def _write_tar(info: BundleInfo, sources: dict[str, Path]) -> None:
    """Write next to `info.path` and rename, so a reader never sees half a bundle there."""
    # 0644: mkstemp's 0600 would hide the bundle from the service user that imports it
    with (replaced_whole(info.path, mode=0o644) as tmp, open(tmp, "wb") as raw,
          tarfile.open(fileobj=raw, mode="w:gz", compresslevel=6) as tar):
        data = json.dumps(info.header(), indent=1, sort_keys=True).encode()
        tar.addfile(_member(BUNDLE_JSON, len(data), 0o644), io.BytesIO(data))
        for f in info.files:
            with open(sources[f.path], "rb") as handle:
                reader = HashingReader(handle)
                tar.addfile(_member(f.path, f.size, f.mode), reader)
            if reader.hexdigest() != f.sha256:
                raise RuntimeError(f"{sources[f.path]} changed during export (is a compile running?); try again")


def _member(name: str, size: int, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, mode, int(time.time())
    return info


@dataclass
class Published:
    """What `cache publish` uploaded, and the pinned hf:// address a new machine fetches it from."""

    info: BundleInfo
    sha256: str
    size: int
    pinned: str  # hf://...@<commit>: the exact upload, whatever is pushed to the branch later
    commit_url: str = ""

    def lines(self) -> list[str]:
        """What to paste: the flags, and the same as a Space's variables."""
        return [f"--cache-bundle {self.pinned} --cache-bundle-sha256 {self.sha256}",
                f"NEURON_UI_CACHE_BUNDLE={self.pinned}",
                f"NEURON_UI_CACHE_BUNDLE_SHA256={self.sha256}"]


def publish_bundle(cache: CachePaths, key: CompileKey, target: str, resolutions: list[str] | None = None,
                   api: Any = None) -> Published:
    """Export `key`'s compiled shapes and upload the bundle to `target` (hf://...) with `api` (an HfApi).

    The bundle is written to a staging folder in the cache folder (swept if this is killed) and removed after the
    upload. A model or dataset repo that does not exist yet is created private; a Space must exist already."""
    source = parse_bundle_source(target)
    if source.kind != "hub":
        raise ValueError(f"--to {target[:200]!r}: publish uploads to the Hub: hf://<owner>/<repo>/<path>[@revision]")
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    with staging_folder(cache.root) as staging:
        info = export_bundle(cache, key, staging, resolutions)  # named by its key
        size, sha256 = hash_file(info.path)
        try:
            if source.repo_type != "space":
                api.create_repo(source.repo_id, repo_type=source.repo_type, private=True, exist_ok=True)
            commit = api.upload_file(
                path_or_fileobj=str(info.path), path_in_repo=source.filename, repo_id=source.repo_id,
                repo_type=source.repo_type, revision=source.revision,
                commit_message=f"neuron-ui compile cache: {', '.join(info.resolutions)} "
                               f"({key.model}, {key.mode}, {key.backend}, {key.dtype}, key {key.digest})")
        except Exception as error:  # noqa: BLE001 the Hub's HTTP errors, no token, no network: one line
            raise ValueError(f"uploading to {target} failed: {first_line(error)}") from None
    revision = getattr(commit, "oid", None) or source.revision or "main"
    prefix = {"model": "", "dataset": "datasets/", "space": "spaces/"}[source.repo_type]
    pinned = f"hf://{prefix}{source.repo_id}/{source.filename}@{revision}"
    logger.info("published %s (%s, sha256 %s) as %s", ", ".join(info.resolutions), human_bytes(size), sha256, pinned)
    return Published(info, sha256, size, pinned, getattr(commit, "commit_url", "") or "")
