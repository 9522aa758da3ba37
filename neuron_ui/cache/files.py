"""The cache's files on disk: walking a folder, hashing a file or a stream, removing a path; shared by the cache's
commands (ls, export, import, publish, clear) and the bundle fetch."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from neuron_ui.config.cache_paths import STAGING_PREFIX

logger = logging.getLogger(__name__)

SKIPPED_DIRS = {"locks"}  # inductor's empty filelock files, recreated on demand
CHUNK = 2**20


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


def hash_file(path: Path) -> tuple[int, str]:
    """The file's size and sha256, read in chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def hash_stream(handle: BinaryIO) -> str:
    """The sha256 of what is left in handle, read in chunks."""
    digest = hashlib.sha256()
    while chunk := handle.read(CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


class Readable(Protocol):
    """What tarfile and gzip read from: bytes on demand."""

    def read(self, size: int = -1, /) -> bytes: ...


class HashingReader:
    """Hash what tarfile reads, so the bytes archived are the bytes listed."""

    def __init__(self, handle: BinaryIO):
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
