"""Uploads on disk, bounded: a total budget with a one-line refusal past it, and removal once unused for a while.

Gradio writes every upload (POST /gradio_api/upload: gradio_client's handle_file, the browser's file inputs and
the image editor) into its upload folder, here the app's private folder (files.py, private_file_folder), as
`<sha256>/<name>` with the multipart parser's temporary `tmp*` file beside it, and keeps it until the process exits:
40 x 25 MB uploads once added 1 GB in 5 s. The gate asks `admit` before each upload reaches Gradio: its declared
length must fit in what is left of the budget, or it is refused in one line, unread. A sweep at each
housekeeping (web/gradio_mount.py, every 30 s) and before any refusal removes uploads unused for `retention` seconds
(a request that names one restarts its clock: contract/files.py, StoredFiles.use) and counts what is left, each file
at least FILE_COST bytes, so a thousand tiny files cost what they take on disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

UPLOAD_FOLDER = re.compile(r"[0-9a-f]{64}")  # Gradio's <sha256 of the bytes>/ folder of one upload
PARSER_TEMP = re.compile(r"tmp\w+")  # a multipart parser's file, left behind when its client went away
FILE_COST = 8192  # the least one file is counted for: a block for its data and one for its folder


@dataclass(frozen=True)
class UploadRefusal:
    """Why an upload is refused, in one line, and its HTTP status: 411 (no Content-Length), 413 (more than the whole
    budget) or 507 (no room now; a few minutes frees some)."""

    status: int
    message: str


class UploadFolder:
    """The uploads in `root`: at most `budget` bytes, each removed `retention` seconds after its last use."""

    def __init__(self, root: Path, budget: int, retention: float, clock: Callable[[], float] = time.time):
        self.root = Path(root)
        self.budget = budget
        self.retention = retention
        self.clock = clock
        self._lock = threading.Lock()
        self._counted = 0  # on disk at the last sweep
        self._since = 0  # admitted and finished since the last sweep (their files are on disk, uncounted)
        self.arriving = 0  # bytes admitted for uploads still arriving (done() not yet called)

    @property
    def used(self) -> int:
        return self._counted + self._since + self.arriving

    def admit(self, length: int | None) -> UploadRefusal | None:
        """Reserve `length` bytes for one upload request (then call `done`), or say why not. May sweep: call it
        from a thread, not the event loop."""
        limit = f"{self.budget / 2**20:g} MB"
        if length is None:
            return UploadRefusal(411, "an upload must say its size (a Content-Length header)")
        if length > self.budget:
            return UploadRefusal(413, f"this upload is {length / 2**20:.1f} MB; uploads may take {limit} in all")
        with self._lock:
            fits = self.used + length <= self.budget
        if not fits:
            self.sweep()
        with self._lock:
            if self.used + length > self.budget:
                minutes = max(1, round(self.retention / 60))
                return UploadRefusal(507, f"the server's {limit} for uploads is full (each is kept {minutes} min "
                                     "after its last use); try again in a few minutes")
            self.arriving += length
        return None

    def done(self, length: int, files: int) -> None:
        """An admitted upload ended; `files` it wrote (0 if it failed) count at least FILE_COST each."""
        with self._lock:
            self.arriving -= length
            self._since += length + files * FILE_COST

    def sweep(self) -> None:
        """Remove the uploads unused for `retention` seconds, and count the rest: the files in Gradio's upload folders,
        and the parsers' leftovers."""
        deadline = self.clock() - self.retention
        total = removed = 0
        folders: list[str] = []
        files: list[str] = []
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.root):
                if UPLOAD_FOLDER.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                    folders.append(entry.path)
                    with contextlib.suppress(OSError):
                        files.extend(item.path for item in os.scandir(entry.path))
                elif PARSER_TEMP.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    files.append(entry.path)
        for path in files:
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                if info.st_mtime < deadline:
                    os.unlink(path)
                    removed += 1
                else:
                    total += max(info.st_size, FILE_COST)
        for folder in folders:
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only once empty
        with self._lock:
            self._counted, self._since = total, 0
        if removed:
            logger.info("removed %d uploads unused for %.0f s; %.1f MB of uploads kept", removed, self.retention,
                        total / 2**20)
