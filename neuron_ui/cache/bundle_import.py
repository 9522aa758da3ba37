"""Import a bundle: verified, all-or-nothing, keys checked field by field."""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import stat
import tarfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from neuron_ui.cache.admin import CHUNK, HashingReader, hash_stream
from neuron_ui.cache.bundle_format import (
    BUNDLE_JSON,
    BundleError,
    BundleInfo,
    check_key,
    check_room,
    read_header,
    safe_parts,
)
from neuron_ui.cache.manifest import CacheManifest
from neuron_ui.config.cache_paths import STAGING_PREFIX, free_bytes, replaced_whole, staging_folder
from neuron_ui.config.settings import parse_sha256
from neuron_ui.contract.errors import first_line
from neuron_ui.images.decode import open_regular

if TYPE_CHECKING:
    from neuron_ui.cache.bundle_format import BundleFile
    from neuron_ui.compile.key import CompileKey
    from neuron_ui.config.cache_paths import CachePaths

logger = logging.getLogger(__name__)


def import_bundle(cache: CachePaths, key: CompileKey, bundle: Path, sha256: str | None = None,
                  label: str | None = None) -> BundleInfo:
    """Verify a bundle against this machine's compile key and its own checksums, then add it to the cache.

    Refused (BundleError, cache untouched) on a sha256 other than the pinned one (`sha256`, the digest of
    the whole bundle file), a different compile key, a bundle.json outside the schema, more declared bytes
    than the cache folder has free, a corrupt or truncated archive, a checksum mismatch, or any member that
    is not a plain file at a relative path under inductor/ or neff/. Files already in the cache are kept:
    their names are content hashes, so they hold the same thing. Messages name the bundle as `label` (where it
    came from, for a fetched one) or its path.
    """
    bundle = Path(bundle)
    shown = label or str(bundle)
    info: BundleInfo | None = None
    with staging_folder(cache.root) as staging:
        try:
            with open_bundle(bundle, shown) as raw:
                if sha256 is not None:  # before reading a byte of it as a bundle: it may not be the one we trust
                    _check_sha256(hash_stream(raw)[1], sha256, shown)
                    raw.seek(0)
                reader = HashingReader(raw)
                # gzip rather than tarfile's own "r|gz": only GzipFile checks the CRC and length at the end.
                # typeshed's GzipFile wants a seekable fileobj; reading forward, as here, never seeks.
                with (gzip.GzipFile(fileobj=reader, mode="rb") as gz,  # type: ignore[call-overload]
                      tarfile.open(fileobj=gz, mode="r|") as tar):
                    info = read_header(tar, shown)
                    info.path = bundle
                    check_key(info, key, shown)
                    check_room(cache.root, free_bytes(cache.root), info.bytes, f"{shown} holds")
                    _extract_verified(tar, staging, {f.path: f for f in info.files}, shown)
                    while gz.read(CHUNK):  # to the very end, so a bundle cut short is refused even in its padding
                        pass
                while reader.read(CHUNK):
                    pass
            if sha256 is not None:  # what was extracted is what was pinned, even if the file changed meanwhile
                _check_sha256(reader.hexdigest(), sha256, shown)
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as error:
            raise BundleError(f"{shown} is corrupt or truncated ({first_line(error)}); nothing was changed. "
                              "Copy it again or export a new one.") from error
        except OSError as error:  # before its header: the bundle file itself could not be opened or read
            if info is not None:
                raise
            raise BundleError(f"{shown} is not a readable bundle ({first_line(error)}); nothing was changed") from error
        for f in info.files:  # each verified file moved into the cache
            section, _, rest = f.path.partition("/")
            dest = getattr(cache, section) / rest
            if dest.exists() or dest.is_symlink():  # an identical name: the same content hash, kept as it is
                info.kept_files += 1
                continue
            # by a name of its own first: a copy (NEFF folder on another filesystem) is never seen half written
            with replaced_whole(dest, prefix=STAGING_PREFIX, suffix="") as tmp:
                shutil.move(staging / f.path, tmp)
    # this cache's own records win, as they were measured here
    added, kept = CacheManifest(cache.manifest).merge(key, info.shapes)
    info.added_shapes.extend(added)
    info.kept_shapes.extend(kept)
    logger.info("imported %s: %d files (%d already here), shapes added %s, kept %s", shown, len(info.files),
                info.kept_files, info.added_shapes or "none", info.kept_shapes or "none")
    return info


def open_bundle(bundle: Path, shown: str) -> BinaryIO:
    """The bundle opened for reading if it is a regular file (images/decode.py's open_regular, which says why a FIFO
    cannot hang start-up); BundleError (one line) otherwise."""

    def refuse(kind: int) -> BundleError:
        what = "a FIFO" if stat.S_ISFIFO(kind) else "a folder" if stat.S_ISDIR(kind) else "not a regular file"
        return BundleError(f"{shown} is {what}: a bundle is a regular file, as `cache export` writes it; "
                           "nothing was changed")

    return open_regular(bundle, shown, refuse)


def _check_sha256(got: str, expected: str, bundle: str) -> None:
    if got != parse_sha256(expected):
        raise BundleError(f"{bundle} is not the pinned bundle: expected sha256 {parse_sha256(expected)}, got {got}; "
                          "nothing was changed. Import only bundles you trust, and pin the digest of the one you "
                          "exported or published (--cache-bundle-sha256); check a remote one's URL and revision.")


def _extract_verified(tar: tarfile.TarFile, staging: Path, expected: dict[str, BundleFile], bundle: str) -> None:
    """Stream every member into `staging`, checking type, path, size and sha256; refuse anything else."""
    seen: set[str] = set()
    while (member := tar.next()) is not None:  # not `for member in tar`: that yields bundle.json again
        if member.isdir():
            safe_parts(member.name, bundle, is_file=False)
            continue
        if not member.isreg():
            raise BundleError(f"{bundle} holds {member.name!r}, which is not a plain file (a link or device); "
                              "refusing it, nothing was changed")
        parts = safe_parts(member.name, bundle)
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
        source = tar.extractfile(member)
        if source is None:  # a regular member (checked above) always has its data
            raise BundleError(f"{bundle}: {name} has no data; nothing was changed")
        with source, open(target, "xb") as sink:  # tarfile reads member.size bytes exactly, or raises ReadError
            reader = HashingReader(source)
            shutil.copyfileobj(reader, sink, CHUNK)
        if reader.hexdigest() != want.sha256:
            raise BundleError(f"{bundle}: {name} does not match its checksum (corrupt bundle); nothing was changed")
        os.chmod(target, (want.mode & 0o755) | 0o600)
    absent = sorted(set(expected) - seen)
    if absent:
        raise BundleError(f"{bundle} lacks {len(absent)} listed files (truncated?), e.g. {absent[0]}; "
                          "nothing was changed")

