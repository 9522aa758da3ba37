"""Which files a caller may name; no torch, no Gradio.

A file value from a caller (an API call's FileData with or without "meta", a bare path, a reference list, the image
editor's background and layers) names a path on the server. Only files this app stored may be read: its uploads
and its results, all inside one private folder (web/files.py, private_file_folder; the results through its one link,
to the images' folder in the cache folder). `StoredFiles.resolve` decides
that from the string alone, before anything touches the disk, so a refusal is the same for a file that exists and
one that does not. The server's gate and the UI's handlers both call it: this is the one copy of the rule.
Opening one is neuron_ui/images/decode.py's (`open_regular`: regular files only).
"""

from __future__ import annotations

import os
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from neuron_ui.contract.checks import shown

MAX_PATH_CHARS = 4096


class ForeignFile(ValueError):
    """A file value names a file this app did not store (or is not a path at all); nothing was read."""


@dataclass(frozen=True)
class StoredFiles:
    """The folder of files this app stored (uploads and results): the only files a request may name."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(os.path.realpath(self.root)))

    @property
    def prefix(self) -> str:
        return str(self.root) + os.sep

    def resolve(self, path: object) -> str:
        """`path` as an absolute path inside the folder (a relative one is taken inside it), or ForeignFile.

        A string check only ('..' folded, no link followed, nothing on disk read): the only links there are the app's
        own, each to its images' folder, all of whose files are the app's."""
        full = None
        if isinstance(path, str) and path and len(path) <= MAX_PATH_CHARS and "\x00" not in path:
            full = os.path.normpath(os.path.join(self.root, path))  # an absolute `path` stays itself
        if full is None or not full.startswith(self.prefix):
            raise ForeignFile(f"{shown(path, 80)} is not a file of this app: upload it first (POST /gradio_api/upload)")
        return full

    def use(self, path: object) -> str:
        """resolve(), and the file's retention clock restarts (web/uploads.py removes uploads unused for a while)."""
        full = self.resolve(path)
        with suppress(OSError, NotImplementedError):  # gone, or never there: the read that follows says so in one line
            os.utime(full, times=(time.time(),) * 2, follow_symlinks=False)
        return full
