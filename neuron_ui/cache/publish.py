"""`cache publish`: export a bundle and upload it to the Hub, and say what a new Space sets to start warm from it."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuron_ui.cache.admin import human_bytes
from neuron_ui.cache.bundle_export import export_bundle
from neuron_ui.cache.bundle_format import bundle_name
from neuron_ui.cache.bundle_source import parse_bundle_source
from neuron_ui.cache.files import hash_file, remove_path
from neuron_ui.config.cache_paths import staging_prefix
from neuron_ui.contract.errors import first_line

if TYPE_CHECKING:
    from neuron_ui.cache.bundle_format import BundleInfo
    from neuron_ui.compile.key import CompileKey
    from neuron_ui.config.cache_paths import CachePaths

logger = logging.getLogger(__name__)


@dataclass
class Published:
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
    staging = Path(tempfile.mkdtemp(dir=cache.root, prefix=staging_prefix()))
    try:
        info = export_bundle(cache, key, staging / bundle_name(key), resolutions)
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
    finally:
        remove_path(staging)
    revision = getattr(commit, "oid", None) or source.revision or "main"
    prefix = {"model": "", "dataset": "datasets/", "space": "spaces/"}[source.repo_type]
    pinned = f"hf://{prefix}{source.repo_id}/{source.filename}@{revision}"
    logger.info("published %s (%s, sha256 %s) as %s", ", ".join(info.resolutions), human_bytes(size), sha256, pinned)
    return Published(info, sha256, size, pinned, getattr(commit, "commit_url", "") or "")
